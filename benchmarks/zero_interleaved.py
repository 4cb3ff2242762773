"""ZeRO stages against DeepSpeed, DDP, FSDP2 and the compute floor, step by step in the same processes.

`zero_stages.py` runs each configuration in its own processes, at its own moment; on a shared VM the
same configuration moves by 10-20% between moments, more than the 5-10% the targets ask to resolve.
Here every rank builds all the requested configurations (each its own copy of the same model, seed 0)
and runs them in turn, one step each, the order rotating every step; an untimed barrier starts every
step together. Two configurations' i-th steps are then seconds apart, so the machine's drift moves
both, and their ratio is taken step by step: `paired` is the median over steps of a_i / b_i.

The floor (`floor-full`, `floor-sharded`) is the same work as `zero_stages.py`'s floor, with no
communication: forward + backward, then AdamW over all parameters or, timed apart, over one flat tensor
of 1/world of the elements. The setup (model, batch, optimizer, config) is `zero_stages.py`'s. No
memory figures: the configurations share a process (`zero_stages.py` measures RSS).

    DS_ACCELERATOR=cpu PYTHONPATH=src:. .dsvenv/bin/python benchmarks/zero_interleaved.py --steps 20
    PYTHONPATH=src .venv/bin/python benchmarks/zero_interleaved.py --configs floor,shardwise-0,ddp   # no DeepSpeed

Prints the JSON and writes benchmarks/results/zero_interleaved.json (see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import LoadSampler, has_deepspeed, log, paired_ratio, spawn, token_batches, verdict, write_report
from zero_stages import (CONFIGS, REFERENCES, RESULTS, TARGETS, WORLD, _build, _torch_adamw, add_setup_args,
                         setup_of)


def _floor(model: Any) -> Any:
    """The floor's step: {part: seconds} for forward + backward, AdamW over everything, AdamW over a shard."""
    import torch

    opt, _ = _torch_adamw(model.param_groups())
    shard = torch.nn.Parameter(torch.randn(-(-model.num_parameters() // WORLD)) * 0.02)
    shard.grad = torch.randn_like(shard) * 1e-3
    shard_opt, _ = _torch_adamw([shard])

    def step(x: Any, y: Any) -> dict[str, float]:
        parts = {}
        for part, fn in (("fwd_bwd", lambda: model(x, y).backward()),
                         ("adam_full", lambda: (opt.step(), opt.zero_grad(set_to_none=True))),
                         ("adam_shard", shard_opt.step)):
            start = time.perf_counter()
            fn()
            parts[part] = time.perf_counter() - start
        return parts

    return step


def _rank_main(rank: int, kinds: list[str], preset_name: str, seq_len: int, micro: int, warmup: int, steps: int,
               threads: int, zero_extra: dict[str, Any] | None) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    if any(k.startswith("deepspeed") for k in kinds):
        import deepspeed as ds

        ds.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    from examples.demo.model import GPT, preset

    steps_of = {}
    for kind in kinds:
        torch.manual_seed(0)
        model = GPT(preset(preset_name, seq_len=seq_len))
        steps_of[kind] = _floor(model) if kind == "floor" else _build(kind, model, micro, zero_extra)[0]
        torch.set_num_threads(threads)  # whatever a library chose at init
    batches = token_batches(model.cfg.vocab_size, micro, seq_len, warmup + steps, rank)
    times: dict[str, list[Any]] = {k: [] for k in kinds}
    for i, (x, y) in enumerate(batches):
        for kind in kinds[i % len(kinds):] + kinds[: i % len(kinds)]:
            dist.barrier()
            start = time.perf_counter()
            parts = steps_of[kind](x, y)
            times[kind].append(parts if kind == "floor" else time.perf_counter() - start)
    dist.barrier()
    return {kind: t[warmup:] for kind, t in times.items()}


def _series(ranks: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per configuration, per step, the slower rank's seconds (the floor as floor-full and floor-sharded)."""
    out = {}
    for kind in ranks[0]:
        if kind == "floor":
            for name, adam in (("floor-full", "adam_full"), ("floor-sharded", "adam_shard")):
                out[name] = [max(r["floor"][i]["fwd_bwd"] + r["floor"][i][adam] for r in ranks)
                             for i in range(len(ranks[0]["floor"]))]
        else:
            out[kind] = [max(ts) for ts in zip(*(r[kind] for r in ranks))]
    return out


def summarize(series: dict[str, list[float]]) -> dict[str, Any]:
    rows: dict[str, Any] = {k: {"step_time_s_median": round(statistics.median(v), 4), "step_time_s_min": round(min(v), 4),
                                "step_times_s": [round(t, 4) for t in v]} for k, v in series.items()}
    ratios: dict[str, Any] = {}
    for a, b, target in TARGETS:
        if a in series and b in series:
            ratios[f"{a}/{b} paired"] = verdict(paired_ratio(series[a], series[b]), target)
    for a, b in REFERENCES:
        if a in series and b in series:
            ratios[f"{a}/{b} paired (reference)"] = paired_ratio(series[a], series[b])
    rows["ratios"] = ratios
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="bench33m", help="a preset of examples/demo/model.py")
    default = [c for c in CONFIGS if c not in ("floor-alone", "shardwise-3-reshard")]  # RSS is what -reshard is for
    parser.add_argument("--configs", default=",".join(default),
                        help="floor and any of " + ",".join(c for c in CONFIGS if not c.startswith("floor")))
    add_setup_args(parser)
    parser.add_argument("--steps", type=int, default=12, help="timed steps of every configuration")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--out", default=str(RESULTS / "zero_interleaved.json"))
    args = parser.parse_args(argv)

    kinds = [k for k in args.configs.split(",") if has_deepspeed() or not k.startswith("deepspeed")]
    load = LoadSampler()
    started = time.perf_counter()
    result = spawn(_rank_main, WORLD, (kinds, args.preset, args.seq_len, args.micro_batch, args.warmup, args.steps,
                                       args.threads, args.zero), args.timeout)
    log(f"[{args.preset}] {len(kinds)} configurations interleaved: {time.perf_counter() - started:.0f} s")
    report: dict[str, Any] = {
        "benchmark": "zero_interleaved",
        "setup": {**setup_of(args), "preset": args.preset, "warmup": args.warmup, "steps": args.steps,
                  "configs": kinds},
        "results": result if isinstance(result, dict) else summarize(_series(result)),
    }
    report["setup"]["load_average"] = load.summary()
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
