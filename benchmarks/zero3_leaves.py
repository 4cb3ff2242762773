"""What ZeRO-3's per-module hooks cost: the bench GPT at world 2 as built (hooks on every module holding a unit:
110 linear layers) against the same model with its blocks marked as leaves (`set_z3_leaf_modules`: hooks on the
27 blocks, each gathering its four units; the units, their gathers and gradient reductions are the same). Both
engines live in the same two processes and steps alternate between them (ABBA), so the machine's drift cancels;
`paired` is the median over steps of leaves / per-module step time (see zero_interleaved.py for why pairs).
The config is ab.py's (DeepSpeed's stage-3 defaults).

    PYTHONPATH=src .venv/bin/python benchmarks/zero3_leaves.py
    PYTHONPATH=src .venv/bin/python benchmarks/zero3_leaves.py --preset demo --steps 2 --out /tmp/l.json

Prints the JSON and writes benchmarks/results/zero3_leaves.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import RESULTS, environment, log, paired_ratio, spawn, token_batches, write_report

WORLD = 2


def _rank(rank: int, preset: str, seq_len: int, micro: int, steps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import shardwise
    from examples.demo.model import GPT, Block, preset as make_preset
    from zero_stages import ds_config

    torch.set_num_threads(1)
    engines = {}
    for kind in ("per_module", "leaves"):
        torch.manual_seed(0)
        model = GPT(make_preset(preset, seq_len=seq_len))
        if kind == "leaves":
            shardwise.zero.set_z3_leaf_modules(model, [Block])
        engines[kind], *_ = shardwise.initialize(model=model, model_parameters=model.param_groups(),
                                                 config=ds_config(3, micro))
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {"per_module": [], "leaves": []}
    hooked = {kind: len(engine.strategy.hooks.units_of) for kind, engine in engines.items()}
    for i, (x, y) in enumerate(token_batches(engines["leaves"].module.cfg.vocab_size, micro, seq_len, 2 * steps + 4, rank)):
        kind = "leaves" if i % 4 in (1, 2) else "per_module"
        engine = engines[kind]
        dist.barrier()
        start = time.perf_counter()
        engine.backward(engine(x, y))
        engine.step()
        if i >= 4:  # the first two of each warm up (and record ZeRO-3's module order)
            times[kind].append(time.perf_counter() - start)
    return {**times, "hooked_modules": hooked}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="bench33m")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--steps", type=int, default=16, help="timed steps of each kind")
    parser.add_argument("--out", default=str(RESULTS / "zero3_leaves.json"))
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"benchmark": "zero3_leaves", "preset": args.preset, "seq_len": args.seq_len,
                              "micro": args.micro, "world": WORLD, "threads_per_rank": 1}
    ranks = spawn(_rank, WORLD, (args.preset, args.seq_len, args.micro, args.steps), 3600)
    if isinstance(ranks, dict):
        report["error"] = ranks
    else:
        slowest = {k: [max(r[k][i] for r in ranks) for i in range(len(ranks[0][k]))] for k in ("per_module", "leaves")}
        ratios = sorted(b / a for a, b in zip(slowest["per_module"], slowest["leaves"]))
        report.update(paired_leaves_over_per_module=paired_ratio(slowest["leaves"], slowest["per_module"]),
                      p10_p90=[round(ratios[len(ratios) // 10], 3), round(ratios[-1 - len(ratios) // 10], 3)],
                      median_s={k: round(statistics.median(v), 4) for k, v in slowest.items()},
                      hooked_modules=ranks[0]["hooked_modules"], steps_s=slowest)
        log("leaves / per-module", report["paired_leaves_over_per_module"])
    report["environment"] = environment()
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
