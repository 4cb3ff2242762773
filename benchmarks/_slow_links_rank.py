"""One rank of a `slow_links.py` run, started by the parent inside a namespace host:

    python benchmarks/_slow_links_rank.py SPEC.json OUT.json      (env: RANK, WORLD_SIZE, MASTER_ADDR, ...)

Builds the model of SPEC, trains `warmup` steps, then, after a barrier, resets the engine's comm stats,
reads this host's interface counters (sysfs of its network namespace) and trains `steps` measured steps,
timing each (forward + backward + step); after another barrier it reads the counters again. Writes OUT.json:
the per-step times, losses (warm-up included, for the oracle), comm bytes and calls per (group, op) per
measured step, the interface's counters over the measured steps, and per step (warm-up included) the time,
the bytes the comm stats counted and the interface's counters moved; or {"error": traceback}.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: F401 - puts the repository and src/ on sys.path
from _netns import read_counters
from _slow_links_models import batch, build, ds_config, loss_of


def _comm_per_step(stats: Any, steps: int) -> dict[str, dict[str, dict[str, Any]]]:
    """{group: {op: {bytes, calls, by_size: {message bytes: calls}}}} per step since the stats' reset."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for (op, group), s in stats.ops.items():
        out.setdefault(group, {})[op] = {"bytes": s.bytes / steps, "calls": s.calls / steps,
                                         "by_size": {str(n): size.calls / steps for n, size in s.by_size.items()}}
    return out


def _issued_bytes(stats: Any) -> int:
    return sum(s.bytes for s in stats.ops.values())


def _record_step(per_step: dict[str, list[int]], issued: int, before: dict[str, int], after: dict[str, int]) -> None:
    """One step's bytes: issued by this rank (comm stats), and its interface's counters (without a barrier: a
    shaped link may still hold the step's last bytes, which then count in the next step)."""
    per_step["comm_bytes"].append(issued)
    for key in ("tx_bytes", "rx_bytes"):
        per_step[key].append(after[key] - before[key])


def train(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import shardwise

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    shardwise.init_distributed(verbose=False)
    model, groups = build(spec)
    engine, *_ = shardwise.initialize(model=model, model_parameters=groups, config=ds_config(spec))
    torch.set_num_threads(1)  # whatever the library chose at init: one thread per rank
    llama = "llama" in spec["model"]
    losses, times, cpu_times = [], [], []
    per_step: dict[str, list[int]] = {"comm_bytes": [], "tx_bytes": [], "rx_bytes": []}
    counters_before: dict[str, int] = {}
    for step in range(spec["warmup"] + spec["steps"]):
        if step == spec["warmup"]:
            dist.barrier()
            engine.comm.stats.reset()
            counters_before = read_counters(spec["interface"])
        tokens = batch(spec, step, rank)
        issued, counters = _issued_bytes(engine.comm.stats), read_counters(spec["interface"])
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = loss_of(engine, tokens, llama)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        losses.append(loss.item())
        _record_step(per_step, _issued_bytes(engine.comm.stats) - issued, counters, read_counters(spec["interface"]))
    # Every rank has received its last step's data once all are here, so it has left every sender's qdisc
    # (gloo calls a send done when the socket took it; a shaped link may still hold it).
    dist.barrier()
    counters_after = read_counters(spec["interface"])
    measured = slice(spec["warmup"], None)
    return {
        "rank": rank, "losses": losses, "step_times_s": times[measured], "cpu_times_s": cpu_times[measured],
        "comm_per_step": _comm_per_step(engine.comm.stats, spec["steps"]),
        "group_sizes": dict(engine.comm.stats.group_sizes),
        "interface": {k: counters_after[k] - counters_before[k] for k in counters_before},
        "per_step": {**per_step, "time_s": times},
    }


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    out = Path(argv[1])
    try:
        result = train(spec)
    except BaseException as e:  # noqa: BLE001 - the parent reads the error from the file
        out.write_text(json.dumps({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}))
        return 1
    out.write_text(json.dumps(result))
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
