"""What the benchmark scripts share: fresh spawned ranks, load sampling, pooling of timed steps, the report.

Each configuration runs in its own freshly spawned set of processes (spawn, not fork: nothing the
parent imported or allocated is inherited, so peak RSS is the configuration's own). A rank function
returns a dict; a rank that raises sends its traceback back instead, and the parent records it as
the configuration's error instead of hanging.
"""

from __future__ import annotations

import json
import os
import platform
import queue
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "benchmarks" / "results"
for _path in (REPO_ROOT, REPO_ROOT / "src"):  # run as a path, with or without shardwise installed
    if str(_path) not in sys.path:
        sys.path.append(str(_path))

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported, here and in the children
os.environ.setdefault("DS_ACCELERATOR", "cpu")

ADAMW = {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}


def rss_mib() -> float:
    """This process's peak resident set so far (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def has_deepspeed() -> bool:
    """The real DeepSpeed is importable (shardwise's compatibility package, also named deepspeed, is not it)."""
    try:
        import deepspeed
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return not str(deepspeed.__version__).endswith("+shardwise")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn: Callable[..., dict[str, Any]], rank: int, world: int, port: int, results: Any, args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        value = fn(rank, *args)
        results.put((rank, value))
    except BaseException as e:  # noqa: BLE001 - the parent must hear about it instead of hanging
        import traceback

        results.put((rank, {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"}))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable[..., dict[str, Any]], world: int, args: tuple, timeout: float) -> list[dict[str, Any]] | dict:
    """`fn(rank, *args)` on `world` fresh processes; the per-rank dicts, or {"error": {rank: text}}."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, results, args)) for r in range(world)]
    for p in procs:
        p.start()
    per_rank: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(per_rank) < world and time.monotonic() < deadline:
            try:
                rank, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in per_rank]
                if dead:
                    per_rank[dead[0]] = {"error": f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}"}
                    break
                continue
            per_rank[rank] = value
            if "error" in value:
                break
        else:
            if len(per_rank) < world:
                per_rank[-1] = {"error": f"timed out after {timeout:.0f} s"}
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
                p.join()
    errors = {r: v["error"] for r, v in per_rank.items() if "error" in v}
    if errors:
        return {"error": errors}
    return [per_rank[r] for r in range(world)]


class LoadSampler:
    """Samples os.getloadavg() every `period` seconds in a thread while the benchmark runs."""

    def __init__(self, period: float = 5.0):
        self.samples: list[float] = [os.getloadavg()[0]]
        self.at_start = os.getloadavg()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period,), daemon=True)
        self._thread.start()

    def _run(self, period: float) -> None:
        while not self._stop.wait(period):
            self.samples.append(os.getloadavg()[0])

    def summary(self) -> dict[str, Any]:
        self._stop.set()
        return {"at_start": [round(x, 2) for x in self.at_start], "at_end": [round(x, 2) for x in os.getloadavg()],
                "one_minute_during": {"min": round(min(self.samples), 2), "median": round(statistics.median(self.samples), 2),
                                      "max": round(max(self.samples), 2), "samples": len(self.samples)},
                "cpu_count": os.cpu_count()}


def pool_steps(runs: list[dict[str, Any]], extra_keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """Pool a configuration's rounds (each: step_times_s, cpu_times_s and per-rank RSS lists)."""
    if any("error" in r for r in runs):
        return {"error": [r["error"] for r in runs if "error" in r]}
    steps = [t for r in runs for t in r["step_times_s"]]
    cpu = [t for r in runs for t in r["cpu_times_s"]]
    ranks = len(runs[0]["peak_rss_mib_per_rank"])
    out = {
        "step_time_s_median": round(statistics.median(steps), 4),
        "step_time_s_min": round(min(steps), 4),
        "step_time_s_median_per_round": [round(statistics.median(r["step_times_s"]), 4) for r in runs],
        "cpu_time_s_median": round(statistics.median(cpu), 4),
        "cpu_time_s_min": round(min(cpu), 4),
        "peak_rss_mib_per_rank": [round(max(r["peak_rss_mib_per_rank"][i] for r in runs), 1) for i in range(ranks)],
        "rss_mib_after_import_per_rank": [round(max(r["rss_mib_after_import"][i] for r in runs), 1) for i in range(ranks)],
    }
    out["rss_growth_mib_per_rank"] = [round(p - i, 1) for p, i in zip(out["peak_rss_mib_per_rank"],
                                                                       out["rss_mib_after_import_per_rank"])]
    for key in extra_keys:
        if key in runs[0]:
            out[key] = runs[0][key]
    return out


def merge_ranks(ranks: list[dict[str, Any]], extra_keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """One run from per-rank results: a step ends when every rank is done (the slower rank's time)."""
    out = {
        "step_times_s": [max(ts) for ts in zip(*(r["step_times_s"] for r in ranks))],
        "cpu_times_s": [max(ts) for ts in zip(*(r["cpu_times_s"] for r in ranks))],
        "peak_rss_mib_per_rank": [r["peak_rss_mib"] for r in ranks],
        "rss_mib_after_import": [r["rss_mib_after_import"] for r in ranks],
    }
    for key in extra_keys:
        if key in ranks[0]:
            out[key] = [r[key] for r in ranks] if key.endswith("_per_rank") else ranks[0][key]
    return out


def ratio(a: dict[str, Any] | None, b: dict[str, Any] | None, key: str, key_b: str | None = None) -> float | None:
    """a[key] / b[key_b or key]; lists compare by their largest element (the worst rank)."""
    key_b = key_b or key
    if not isinstance(a, dict) or not isinstance(b, dict) or key not in a or key_b not in b:
        return None
    x, y = a[key], b[key_b]
    x, y = (max(x) if isinstance(x, list) else x), (max(y) if isinstance(y, list) else y)
    return round(x / y, 3) if y else None


def paired_ratio(a: list[float], b: list[float]) -> float:
    """Median of a_i / b_i: measurements taken side by side (same round, same step) share the machine's drift,
    so it cancels, where a ratio of medians keeps it."""
    return round(statistics.median(x / y for x, y in zip(a, b)), 3)


def paired_spread(a: list[float], b: list[float]) -> dict[str, float]:
    """`paired_ratio` with its 10th-90th percentile spread: median, p10 and p90 of a_i / b_i."""
    ratios = sorted(x / y for x, y in zip(a, b))
    deciles = statistics.quantiles(ratios, n=10) if len(ratios) > 1 else ratios * 9
    return {"median": round(statistics.median(ratios), 4), "p10": round(deciles[0], 4), "p90": round(deciles[-1], 4)}


def verdict(value: float | None, target: float, at_most: bool = True) -> dict[str, Any]:
    if value is None:
        return {"value": None, "target": target, "met": None}
    return {"value": value, "target": f"<= {target}" if at_most else f">= {target}",
            "met": value <= target if at_most else value >= target}


def source_state() -> dict[str, Any]:
    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=False).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "--short", "HEAD"), "src_dirty": bool(git("status", "--porcelain", "src"))}


def environment() -> dict[str, Any]:
    import importlib.metadata

    import torch

    env = {"torch": torch.__version__, "python": platform.python_version(), "cpu_count": os.cpu_count(),
           "host": platform.node(), "shardwise_source": source_state()}
    try:
        version = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        version = "not installed"
    # In .venv "deepspeed" is shardwise's compatibility package: named as such, so that it is never read as the
    # version of the DeepSpeed a figure was measured against (a peer runs in its own interpreter: `peer_version`).
    env["deepspeed_compat" if version.endswith("+shardwise") else "deepspeed"] = version
    return env


def peer_version(python: str, package: str = "deepspeed") -> str:
    """The version of `package` installed for another interpreter (a peer's venv)."""
    code = f"import importlib.metadata as m; print(m.version({package!r}))"
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    return done.stdout.strip() or f"unknown ({done.stderr.strip()[-200:]})"


def write_report(report: dict[str, Any], out: str | Path) -> None:
    text = json.dumps(report, indent=2)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text + "\n")
    print(text)


def log(*parts: Any) -> None:
    print(*parts, file=sys.stderr, flush=True)


def print_columns(lines: list[list[Any]]) -> None:
    """Rows of cells, each column as wide as its widest cell (the first row is the header)."""
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(lines[0]))]
    for line in lines:
        print("  ".join(str(c).ljust(w) for c, w in zip(line, widths)))


def pyplot() -> Any | None:
    """matplotlib.pyplot on its file-only backend (no display needed), or None when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(plt: Any, fig: Any, path: Path) -> Path:
    """Lay out `fig`, write it to `path` (its folder made if needed) and close it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def token_batches(vocab: int, micro: int, seq_len: int, count: int, rank: int) -> list[tuple[Any, Any]]:
    import torch

    g = torch.Generator().manual_seed(1234 + rank)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, vocab, (micro, seq_len + 1), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out
