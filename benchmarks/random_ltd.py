"""random-LTD: step time with the middle layers at a fraction of the tokens against the same model without it,
and what it costs in quality (validation loss after the same steps from the same seed).

Speed: the bench GPT (examples/demo/model.py, `--preset`, random tokens) at world 2, ZeRO `--stage`; every
rank builds both engines (each its own copy of the model, seed 0) and runs them in turn, one step each, the
order rotating every step, an untimed barrier before each step; `paired` is the median over steps of the
random-LTD step time / the plain one (see zero_interleaved.py for why pairs). random-LTD keeps
`--keep` of the tokens (fixed) in every layer but the first and the last.

Quality: the demo preset on the bundled King James text (the demo's data, AdamW and schedule), both runs from
seed 0 on the same batches, interleaved the same way; random-LTD's kept count ramps from `--keep` of the
tokens to all of them over the first `--ramp` of the steps (the paper's schedule shape). The figure is the
validation loss (examples/demo/train.py's fixed batches) after `--quality-steps` steps.

    PYTHONPATH=src .venv/bin/python benchmarks/random_ltd.py                       # the lead's run
    PYTHONPATH=src .venv/bin/python benchmarks/random_ltd.py --preset demo --seq-len 64 --steps 2 \\
        --quality-steps 2 --out /tmp/random_ltd.json                                 # smoke

Prints the JSON and writes benchmarks/results/random_ltd.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (REPO_ROOT, RESULTS, LoadSampler, environment, log, paired_ratio, spawn, token_batches,
                      write_report)

WORLD = 2
KINDS = ("plain", "random-ltd")


def _ltd(n_layer: int, seq_len: int, keep: float, ramp_steps: int | None) -> dict[str, Any]:
    kept = max(1, int(seq_len * keep))
    layers = list(range(1, n_layer - 1))
    schedule = {"min_value": kept, "max_value": seq_len if ramp_steps else kept, "schedule_type": "fixed_linear",
                "schedule_config": {"require_steps": ramp_steps or 1, "seq_per_step": 1}}
    ltd = {"enabled": True, "random_ltd_layer_id": layers, "random_ltd_layer_num": len(layers),
           "total_layer_num": n_layer, "random_ltd_schedule": schedule}
    return {"enabled": True, "data_routing": {"enabled": True, "random_ltd": ltd}}


def _engines(cfg: Any, base: dict[str, Any], keep: float, ramp_steps: int | None) -> dict[str, Any]:
    import torch

    import shardwise
    from examples.demo.model import GPT

    engines = {}
    for kind in KINDS:
        torch.manual_seed(0)
        model = GPT(cfg)
        config = dict(base)
        if kind == "random-ltd":
            config["data_efficiency"] = _ltd(cfg.n_layer, cfg.seq_len, keep, ramp_steps)
        engines[kind] = shardwise.initialize(model=model, model_parameters=model.param_groups(), config=config)[0]
    return engines


def _interleave(engines: dict[str, Any], batches: list[tuple[Any, Any]]) -> dict[str, list[float]]:
    import torch.distributed as dist

    times: dict[str, list[float]] = {k: [] for k in engines}
    for i, (x, y) in enumerate(batches):
        for kind in KINDS[i % 2:] + KINDS[:i % 2]:
            dist.barrier()
            start = time.perf_counter()
            engine = engines[kind]
            engine.backward(engine(x.to(engine.device), y.to(engine.device)))
            engine.step()
            times[kind].append(time.perf_counter() - start)
    dist.barrier()
    return times


def _speed(rank: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from examples.demo.model import preset

    torch.set_num_threads(args.threads)
    cfg = preset(args.preset, **({"seq_len": args.seq_len} if args.seq_len else {}))
    base = {"train_micro_batch_size_per_gpu": args.micro_batch, "zero_optimization": {"stage": args.stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "steps_per_print": 10**9}
    engines = _engines(cfg, base, args.keep, None)
    batches = token_batches(cfg.vocab_size, args.micro_batch, cfg.seq_len, args.warmup + args.steps, rank)
    times = _interleave(engines, batches)
    return {k: v[args.warmup:] for k, v in times.items()}


def _quality(rank: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from examples.demo.data import TextDataset
    from examples.demo.model import preset
    from examples.demo.train import evaluate, validation_batches

    torch.set_num_threads(args.threads)
    cfg = preset("demo", **({"seq_len": args.seq_len} if args.seq_len else {}))
    base = json.loads((REPO_ROOT / "examples" / "demo" / "ds_config.json").read_text())
    base["scheduler"]["params"]["total_num_steps"] = args.quality_steps
    base["scheduler"]["params"]["warmup_num_steps"] = max(1, args.quality_steps // 10)
    engines = _engines(cfg, base, args.keep, max(1, int(args.quality_steps * args.ramp)))
    data = TextDataset(seq_len=cfg.seq_len, split="train")
    micro = base["train_micro_batch_size_per_gpu"]
    g = torch.Generator().manual_seed(1234)
    batches = []
    for _ in range(args.quality_steps):
        picks = torch.randint(0, len(data), (WORLD * micro,), generator=g)[rank * micro:(rank + 1) * micro]
        windows = [data[int(i)] for i in picks]
        batches.append((torch.stack([x for x, _ in windows]), torch.stack([y for _, y in windows])))
    times = _interleave(engines, batches)
    val = validation_batches(cfg.seq_len, micro, 4)
    return {"val_loss": {k: round(evaluate(e, val), 4) for k, e in engines.items()},
            "train_time_s": {k: round(sum(v), 2) for k, v in times.items()}}


def _summary(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    series = {k: [max(ts) for ts in zip(*(r[k] for r in ranks))] for k in KINDS}
    out: dict[str, Any] = {k: {"step_time_s_median": round(statistics.median(v), 4), "step_time_s_min": round(min(v), 4),
                               "step_time_s_max": round(max(v), 4), "step_times_s": [round(t, 4) for t in v]}
                           for k, v in series.items()}
    out["random-ltd/plain paired"] = paired_ratio(series["random-ltd"], series["plain"])
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="bench33m", help="the speed run's preset of examples/demo/model.py")
    parser.add_argument("--seq-len", type=int, default=None, help="override the presets' sequence length")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--stage", type=int, default=0, help="ZeRO stage of both runs")
    parser.add_argument("--keep", type=float, default=0.5, help="fraction of the tokens the middle layers keep")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12, help="timed steps of each configuration")
    parser.add_argument("--quality-steps", type=int, default=300, help="training steps of the quality runs (0: skip)")
    parser.add_argument("--ramp", type=float, default=0.5, help="share of the quality steps random-LTD ramps over")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--out", default=str(RESULTS / "random_ltd.json"))
    args = parser.parse_args(argv)

    load = LoadSampler()
    started = time.perf_counter()
    speed = spawn(_speed, WORLD, (args,), args.timeout)
    log(f"[{args.preset}] speed: {time.perf_counter() - started:.0f} s")
    quality: Any = None
    if args.quality_steps:
        quality = spawn(_quality, WORLD, (args,), args.timeout)
        quality = quality if isinstance(quality, dict) else quality[0]  # the same on every rank (replicated weights, same validation batches)
    report = {
        "benchmark": "random_ltd",
        "setup": {**vars(args), "world": WORLD, "ltd_layers": "all but the first and the last"},
        "speed": speed if isinstance(speed, dict) else _summary(speed),
        "quality": quality,
        "load": load.summary(),
        "environment": environment(),
    }
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
