"""CPU collectives, three ways through `shardwise.distributed.Collectives`: gloo's own flat collectives,
one gloo broadcast / reduce per rank (`per_rank`), and shared memory (`shm`, the default for same-host ranks).

World size 2 on CPU, one intra-op thread per rank, at the sizes ZeRO moves: a small persistent unit, a
ZeRO-3 unit of the 33.7M GPT (409,600 elements), a mid-size bucket, a 25 MiB gradient bucket (6,553,600
fp32) and the whole 33.7M model. Ops: all-reduce (stage 0), reduce-scatter (stages 1-3), all-gather
(stages 1-3). Per size: the median wall and CPU time (the process's, every thread) of 21 timed calls, each
after a barrier (1 warm-up), the slower rank's. On a 2-core machine whose ranks are busy computing, the CPU
time is what a collective takes from training even when it overlaps.

    .venv/bin/python benchmarks/cpu_collectives.py        # about 2 minutes

Writes benchmarks/results/cpu_collectives.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import RESULTS, LoadSampler, environment, spawn, write_report

WORLD = 2
SIZES = (2_560, 409_600, 4_000_000, 6_553_600, 33_700_000)
CALLS = 22
FORMS = ("gloo", "per_rank", "shm")
OPS = ("all_reduce", "reduce_scatter", "all_gather")


def _rank_main(rank: int, sizes: tuple[int, ...]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from shardwise.distributed import Collectives, Group

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    group = Group("data", dist.group.WORLD, WORLD, rank)
    forms = {"gloo": Collectives(per_rank_on_gloo=False, shm=False), "per_rank": Collectives(shm=False),
             "shm": Collectives(shm=True)}
    out: dict[str, Any] = {}
    for n in sizes:
        full, shard = torch.randn(n), torch.randn(n // WORLD)
        for form, comm in forms.items():
            ops = {"all_reduce": lambda: comm.all_reduce(full, group).wait(),
                   "reduce_scatter": lambda: comm.reduce_scatter(shard, full.clone(), group).wait(),
                   "all_gather": lambda: comm.all_gather(full, shard, group).wait()}
            for op, call in ops.items():
                wall, cpu = [], []
                for _ in range(CALLS):
                    dist.barrier()
                    start, cpu_start = time.perf_counter(), time.process_time()
                    call()
                    wall.append(time.perf_counter() - start)
                    cpu.append(time.process_time() - cpu_start)
                out[f"{op} {n} {form}"] = {"wall_s": statistics.median(wall[1:]), "cpu_s": statistics.median(cpu[1:])}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="comma-separated element counts")
    parser.add_argument("--out", default=str(RESULTS / "cpu_collectives.json"))
    args = parser.parse_args(argv)
    sizes = tuple(int(float(n)) // WORLD * WORLD for n in args.sizes.split(","))
    sampler = LoadSampler()
    ranks = spawn(_rank_main, WORLD, (sizes,), 900)
    if isinstance(ranks, dict):
        raise SystemExit(f"cpu_collectives: {ranks['error']}")
    results: dict[str, Any] = {}
    for op in OPS:
        for n in sizes:
            row: dict[str, Any] = {form: {k: round(max(r[f"{op} {n} {form}"][k] for r in ranks), 5) for k in ("wall_s", "cpu_s")}
                                   for form in FORMS}
            for form in ("per_rank", "shm"):
                for k, label in (("wall_s", "wall"), ("cpu_s", "cpu")):
                    row[f"{form}/gloo {label}"] = round(row[form][k] / row["gloo"][k], 3)
            results[f"{op} {n} elements fp32"] = row
    report = {"benchmark": "cpu_collectives",
              "setup": {"world_size": WORLD, "device": "cpu", "threads_per_rank": 1, "timed_calls": CALLS - 1,
                        **environment(), "load_average": sampler.summary()},
              "results": results}
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
