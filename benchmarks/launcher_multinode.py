"""Multi-node launcher figures on one machine: bus bandwidth between two network-namespace hosts vs
loopback, and launcher start-up time to the first training step.

* Bandwidth: ``shardwise check-comm`` with 2 ranks, once as 1 rank on each of two namespace hosts (veth,
  through the ssh runner), once as 2 local processes (loopback); all_reduce / all_gather / reduce_scatter
  bus bandwidth per message size (nccl-tests' definition, see ``launcher/check_comm.py``).
* Start-up: wall time from starting ``shardwise`` to rank 0 finishing its first optimizer step of TinyNet,
  for 2 nodes × 2 processes (ssh and pdsh runners) and, as the peer figure, 1 node × 4 processes.

Needs root and iproute2 + openssh-server + pdsh (as the multi-node tests do). Two cores: the figures are
about this machine's CPU and kernel, not a network; the ratio netns/loopback is the point.

    sudo .venv/bin/python benchmarks/launcher_multinode.py

Prints the JSON and writes it to benchmarks/results/launcher_multinode.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "src")]

from tests.distributed.test_multinode_hosts import Hosts, make_hosts, remove_hosts, why_unavailable  # noqa: E402

SIZES = "64K,1M,16M"
OPS = "all_reduce,all_gather,reduce_scatter"

FIRST_STEP = """
import os, sys, time, torch
from tests.parity import ds_config, make_model, micro_batch, param_groups
import shardwise
torch.set_num_threads(1)
model = make_model()
engine, _, _, _ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=ds_config(2, 1))
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
engine.backward(engine(*micro_batch(0, 0, rank, 2, 1, world)))
engine.step()
if rank == 0:
    open(sys.argv[-1], "w").write(repr(time.time()))
torch.distributed.destroy_process_group()
"""


def env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return {**base, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO_ROOT / 'src'}:{REPO_ROOT}",
            "TORCH_CPP_LOG_LEVEL": "ERROR", **extra}


def shardwise(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "shardwise.cli", *args]


def comm(cmd: list[str], out: Path, cwd: Path, extra_env: dict[str, str]) -> list[dict[str, Any]]:
    subprocess.run(cmd, cwd=cwd, env=env(**extra_env), check=True, capture_output=True, timeout=300)
    return [r for r in json.loads(out.read_text()) if r["op"] in OPS]


def bandwidth(hosts: Hosts, tmp: Path) -> dict[str, Any]:
    check = ["check-comm", "--sizes", SIZES, "--ops", OPS, "--iters", "10"]
    netns_out, local_out = tmp / "netns.json", tmp / "loopback.json"
    hostfile = hosts.hostfile(tmp / "hf1", slots=1)
    netns = comm(hosts.in_ns(0, shardwise([*check, "--json", str(netns_out), "--hostfile", str(hostfile),
                                           "--launcher", "ssh", "--launcher_args", f"-F {hosts.ssh_config}"])),
                 netns_out, tmp, {})
    loop = comm(shardwise([*check, "--json", str(local_out), "--num_gpus", "2"]), local_out, tmp, {})
    rows = []
    for a, b in zip(netns, loop):
        rows.append({"op": a["op"], "bytes": a["bytes"], "netns_busbw_GBps": round(a["busbw_GBps"], 3),
                     "loopback_busbw_GBps": round(b["busbw_GBps"], 3),
                     "ratio_netns_over_loopback": round(a["busbw_GBps"] / b["busbw_GBps"], 3)})
    return {"ranks": 2, "rows": rows}


def first_step_s(cmd: list[str], tmp: Path, extra_env: dict[str, str]) -> float:
    marker = tmp / f"first-{time.monotonic_ns()}"
    start = time.time()
    subprocess.run([*cmd, str(marker)], cwd=tmp, env=env(**extra_env), check=True,
                   capture_output=True, timeout=300)
    return round(float(marker.read_text()) - start, 2)


def startup(hosts: Hosts, tmp: Path, repeats: int = 2) -> dict[str, Any]:
    (tmp / "first_step.py").write_text(FIRST_STEP)
    hostfile = hosts.hostfile(tmp / "hf2", slots=2)
    runs = {
        "2x2_ssh": (hosts.in_ns(0, shardwise(["--hostfile", str(hostfile), "--launcher", "ssh", "--launcher_args",
                                              f"-F {hosts.ssh_config}", "first_step.py"])), {}),
        "2x2_pdsh": (hosts.in_ns(0, shardwise(["--hostfile", str(hostfile), "--launcher", "pdsh", "first_step.py"])),
                     {"PDSH_SSH_ARGS_APPEND": f"-F {hosts.ssh_config}"}),
        "1x4_local": (shardwise(["--num_gpus", "4", "first_step.py"]), {}),
    }
    return {name: min(first_step_s(cmd, tmp, extra) for _ in range(repeats)) for name, (cmd, extra) in runs.items()}


def main() -> None:
    reason = why_unavailable()
    if reason:
        raise SystemExit(f"needs two namespace hosts: {reason}")
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        hosts = make_hosts(tmp)
        try:
            from _harness import source_state

            result = {"figure": "launcher_multinode", "cpu_cores": os.cpu_count(), "bus_bandwidth": bandwidth(hosts, tmp),
                      "seconds_to_first_step": startup(hosts, tmp), "shardwise_source": source_state()}
        finally:
            remove_hosts(hosts)
    text = json.dumps(result, indent=1)
    print(text)
    (REPO_ROOT / "benchmarks" / "results").mkdir(exist_ok=True)
    (REPO_ROOT / "benchmarks" / "results" / "launcher_multinode.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
