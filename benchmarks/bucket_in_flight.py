"""What bounding the gradient reductions in flight (zero/grad_buckets.py, MAX_IN_FLIGHT = 2) costs in step
time: the bench GPT at world 2, ZeRO stages 2 (buckets of `--bucket` elements) and 3, each step run with the
bound and without it (MAX_IN_FLIGHT set to a huge number), alternating step by step in the same processes;
`paired` is the median over steps of bounded / unbounded step time (see zero_interleaved.py for why pairs).

    PYTHONPATH=src .venv/bin/python benchmarks/bucket_in_flight.py
    PYTHONPATH=src .venv/bin/python benchmarks/bucket_in_flight.py --preset demo --seq-len 64 --steps 2 --out /tmp/b.json

Prints the JSON and writes benchmarks/results/bucket_in_flight.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import RESULTS, environment, log, paired_ratio, spawn, token_batches, write_report

WORLD = 2
UNBOUNDED = 10**9


def _rank(rank: int, preset: str, seq_len: int, micro: int, steps: int, stage: int, bucket: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import shardwise
    from examples.demo.model import from_preset
    from shardwise.zero import grad_buckets

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket}}
    engine, *_ = shardwise.initialize(model=from_preset(preset, seq_len=seq_len), config=config)
    times: dict[str, list[float]] = {"bounded": [], "unbounded": []}
    bound = grad_buckets.MAX_IN_FLIGHT
    for i, (x, y) in enumerate(token_batches(256, micro, seq_len, 2 * steps + 2, rank)):
        kind = "bounded" if i % 2 == 0 else "unbounded"
        grad_buckets.MAX_IN_FLIGHT = bound if kind == "bounded" else UNBOUNDED
        dist.barrier()
        start = time.perf_counter()
        engine.backward(engine(x, y))
        engine.step()
        if i >= 2:  # the first pair warms up
            times[kind].append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="bench33m")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12, help="timed steps of each kind")
    parser.add_argument("--bucket", type=int, default=2_000_000, help="stage 2's reduce_bucket_size (elements)")
    parser.add_argument("--out", default=str(RESULTS / "bucket_in_flight.json"))
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"benchmark": "bucket_in_flight", "preset": args.preset, "seq_len": args.seq_len,
                              "micro": args.micro, "world": WORLD, "bucket": args.bucket}
    for stage in (2, 3):
        ranks = spawn(_rank, WORLD, (args.preset, args.seq_len, args.micro, args.steps, stage, args.bucket), 1800)
        if isinstance(ranks, dict):
            report[f"stage{stage}"] = ranks
            continue
        slowest = {k: [max(r[k][i] for r in ranks) for i in range(len(ranks[0][k]))] for k in ranks[0]}
        report[f"stage{stage}"] = {"paired_bounded_over_unbounded": round(paired_ratio(slowest["bounded"],
                                                                                      slowest["unbounded"]), 3),
                                   "bounded_s": slowest["bounded"], "unbounded_s": slowest["unbounded"]}
        log(f"stage {stage}", report[f"stage{stage}"]["paired_bounded_over_unbounded"])
    report["environment"] = environment()
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
