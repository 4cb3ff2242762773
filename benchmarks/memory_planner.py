"""The memory planner against measured peaks on the bench GPT: for every ZeRO stage and offload mode, the
plan's per-rank peak (planner/plan.py, from the model's shape, the config and the activations the engine
traced) over the peak the CPU allocator reached during step 2 (planner/measure.py), at world 2.

    PYTHONPATH=src .venv/bin/python benchmarks/memory_planner.py                        # the lead's run
    PYTHONPATH=src .venv/bin/python benchmarks/memory_planner.py --preset demo --seq-len 64 \\
        --cases stage0 --out /tmp/memory_planner.json                                    # smoke

Prints the JSON and writes benchmarks/results/memory_planner.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import RESULTS, environment, log, spawn, token_batches, write_report

WORLD = 2
CASES: dict[str, dict[str, Any]] = {
    "stage0": {"stage": 0},
    "stage1": {"stage": 1},
    "stage2": {"stage": 2},
    "stage3": {"stage": 3},
    "stage1-bf16": {"stage": 1, "bf16": True},
    "stage3-bf16": {"stage": 3, "bf16": True},
    "stage2-offload-cpu": {"stage": 2, "offload_optimizer": "cpu"},
    "stage2-offload-nvme": {"stage": 2, "offload_optimizer": "nvme"},
    "stage3-offload-cpu": {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
    "stage3-offload-nvme": {"stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme"},
    "stage3-tight-window": {"stage": 3, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0},
}


def config(case: dict[str, Any], micro: int, nvme: str) -> dict[str, Any]:
    zero = {k: v for k, v in case.items() if k not in ("bf16", "offload_optimizer", "offload_param")}
    for key in ("offload_optimizer", "offload_param"):
        if key in case:
            zero[key] = {"device": case[key], **({"nvme_path": nvme} if case[key] == "nvme" else {})}
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}, "zero_optimization": zero,
            "bf16": {"enabled": bool(case.get("bf16"))}, "memory_breakdown": True, "steps_per_print": 10**9}


def _rank(rank: int, preset: str, seq_len: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    import shardwise
    from examples.demo.model import from_preset

    torch.manual_seed(0)
    engine, *_ = shardwise.initialize(model=from_preset(preset, seq_len=seq_len), config=cfg)
    for x, y in token_batches(256, cfg["train_micro_batch_size_per_gpu"], seq_len, 2, rank):
        engine.backward(engine(x, y))
        engine.step()
    check = engine.plan_probe.check
    return {"planned": check.predicted, "measured": check.measured,
            "parts": {p.name: p.device + p.host for p in check.planned.parts}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="bench33m")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--cases", nargs="*", default=sorted(CASES), choices=sorted(CASES))
    parser.add_argument("--out", default=str(RESULTS / "memory_planner.json"))
    args = parser.parse_args(argv)
    rows = {}
    for name in args.cases:
        with tempfile.TemporaryDirectory() as nvme:
            ranks = spawn(_rank, WORLD, (args.preset, args.seq_len, config(CASES[name], args.micro, nvme)), 900)
        if isinstance(ranks, dict):
            rows[name] = ranks
            continue
        planned, measured = ranks[0]["planned"], ranks[0]["measured"]
        rows[name] = {"planned_mib": round(planned / 2**20, 1), "measured_mib": round(measured / 2**20, 1),
                      "planned_over_measured": round(planned / measured, 3), "parts_mib": {
                          k: round(v / 2**20, 1) for k, v in ranks[0]["parts"].items() if v}}
        log(name, rows[name]["planned_mib"], rows[name]["measured_mib"], rows[name]["planned_over_measured"])
    ratios = [r["planned_over_measured"] for r in rows.values() if "planned_over_measured" in r]
    report = {"benchmark": "memory_planner", "preset": args.preset, "seq_len": args.seq_len, "micro": args.micro,
              "world": WORLD, "cases": rows,
              "summary": {"max_abs_error": round(max(abs(r - 1) for r in ratios), 3) if ratios else None,
                          "median_ratio": statistics.median(ratios) if ratios else None},
              "environment": environment()}
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
