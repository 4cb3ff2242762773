"""Ranks of one training run started inside namespace hosts (`_netns.py`), shared by `slow_links.py` and
`onebit.py`: each rank's environment, the start, the wait, and the per-rank results read back.

A rank script is run as `python SCRIPT SPEC.json OUT.json` (`_slow_links_rank.py` is the one both use): it
writes its results, or {"error": ...}, to OUT.json. Rank r runs on host r // ranks_per_host; the master is
host 0. The ranks run this checkout's src/ (their PYTHONPATH says so), whatever the interpreter has installed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from _harness import REPO_ROOT, log
from _netns import INTERFACE, SwitchedHosts, remove_stale, why_unavailable

RANK_SCRIPT = Path(__file__).resolve().parent / "_slow_links_rank.py"


def require_hosts(script: str) -> None:
    """Exit saying why namespace hosts cannot be made here; else delete the namespaces a killed run left."""
    reason = why_unavailable()
    if reason:
        raise SystemExit(f"{script} needs namespace hosts: {reason}")
    stale = remove_stale()
    if stale:
        log(f"removed namespaces of an earlier run: {', '.join(stale)}")


def print_shaping(links: dict[str, dict[str, Any]]) -> None:
    """How each link was shaped (`Shaping`s as dicts, by link name), under the printed tables."""
    for link, shaping in links.items():
        note = f" ({shaping['note']})" if shaping["note"] else ""
        print(f"{link}: qdisc {shaping['qdisc']}, rate {shaping['rate']}, delay {shaping['delay_ms']} ms{note}")


def rank_env(net: SwitchedHosts, world: int, ranks_per_host: int, rank: int, port: int) -> dict[str, str]:
    """Exactly the environment rank `rank` gets: the launcher's variables, gloo on the host's eth0, one thread."""
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TERM", "TMPDIR")}
    return {**keep, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % ranks_per_host),
            "LOCAL_WORLD_SIZE": str(ranks_per_host), "MASTER_ADDR": net.hosts[0].address,
            "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": INTERFACE,
            "SHARDWISE_NODE": f"h{rank // ranks_per_host}", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), str(REPO_ROOT)]), "TORCH_CPP_LOG_LEVEL": "ERROR",
            "DS_ACCELERATOR": "cpu", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}


def wait(procs: list[Any], timeout: float, grace_s: float = 20.0) -> str | None:
    """None when every rank exited 0 in time; else why (the others get `grace_s` to exit on their own)."""
    deadline = time.monotonic() + timeout
    failed_at = None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + grace_s):
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    if time.monotonic() > deadline and failed_at is None:
        return f"timed out after {timeout:.0f} s"
    codes = [p.returncode for p in procs]
    return None if all(c == 0 for c in codes) else f"exit codes {codes}"


def run_ranks(net: SwitchedHosts, spec: dict[str, Any], world: int, ranks_per_host: int, tmp: Path, port: int,
              timeout: float) -> list[dict[str, Any]] | dict[str, Any]:
    """The per-rank results of one run, or {"error": ...} (the ranks' own message when they wrote one)."""
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(spec))
    procs = []
    for rank in range(world):
        env = rank_env(net, world, ranks_per_host, rank, port)
        procs.append(net.start(rank // ranks_per_host,
                               [sys.executable, str(RANK_SCRIPT), str(spec_path), str(tmp / f"rank{rank}.json")],
                               env, cwd=REPO_ROOT, log=tmp / f"rank{rank}.log"))
    why = wait(procs, timeout)
    results = [json.loads(p.read_text()) if p.exists() else None for p in (tmp / f"rank{r}.json" for r in range(world))]
    errors = sorted({r["error"] for r in results if r and "error" in r})
    if errors or why:
        tails = {r: (tmp / f"rank{r}.log").read_text()[-1500:] for r in range(world) if results[r] is None}
        return {"error": errors[0] if errors else why, "all_errors": errors, "why": why, "log_tails": tails}
    return results
