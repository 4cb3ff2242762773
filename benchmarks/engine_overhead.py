"""The engine's fixed cost per step on small models: shardwise against a plain PyTorch loop and DeepSpeed 0.19.

Where the model is tiny the step is mostly the library's own Python: hooks, bookkeeping, collectives on a
world of one. Two loops:

| model | a step |
| --- | --- |
| `gan` | tests/gan.py's two-engine GAN iteration (DeepSpeed's DCGAN tutorial order): discriminator backward twice and step, generator backward and step; 2x(4-16-1) and (4-16-6) MLPs, micro-batch 4 |
| `gpt` | the demo GPT (examples/demo/model.py, preset "demo"), sequence 128, micro-batch 8: forward, backward, step |

Configurations: `torch` (the same loop with torch.optim.Adam/AdamW, no engine), `shardwise-S` and, run with
--deepspeed-python (a venv with the real DeepSpeed), `deepspeed-S`, for ZeRO stage S. World 1 (one process)
or 2 (gloo, `torch` then uses DDP). Each configuration runs in fresh processes, `--rounds` times in a rotating
order; a run's figure is the median iteration of its slower rank, wall and CPU (all threads of the process).
Ratios are paired: the median over rounds of the two configurations' ratio within a round.

    .venv/bin/python benchmarks/engine_overhead.py --deepspeed-python .dsvenv/bin/python

Writes benchmarks/results/engine_overhead.json. On a machine whose speed drifts between processes (a shared VM:
the plain loop's own time varied 2x between runs here), `--paired` is the figure to quote: at world 1, each stage
and the plain loop alternate iteration by iteration in one process, and each iteration's ratio is taken
(benchmarks/results/engine_overhead_paired.json):

    .venv/bin/python benchmarks/engine_overhead.py --paired --stages 1,2,3 --steps 2000 --models gan
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (REPO_ROOT, RESULTS, LoadSampler, environment, log, paired_ratio, paired_spread, peer_version,
                      print_columns, spawn, token_batches, write_report)

ADAM = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8}


def _loop(model_name: str, library: str, stage: int, world: int) -> Any:
    """(iteration(i), warm-up count): one iteration of the loop on batch i."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO_ROOT))
    if model_name == "gan":
        from tests.gan import MICRO, gan_batch, gan_config, gan_iteration, make_gan

        net_g, net_d = make_gan()
        batches = [gan_batch(i, MICRO) for i in range(64)]
        if library == "torch":
            if world > 1:
                net_g, net_d = (torch.nn.parallel.DistributedDataParallel(m) for m in (net_g, net_d))
            opt_g, opt_d = (torch.optim.Adam(m.parameters(), lr=5e-2, betas=(0.5, 0.999)) for m in (net_g, net_d))
            parts = (net_g, net_d, lambda loss: loss.backward(), opt_d.step, lambda loss: loss.backward(), opt_g.step)
        else:
            ds = _library(library)
            engine_d, *_ = ds.initialize(model=net_d, model_parameters=net_d.parameters(), config=gan_config(stage))
            engine_g, *_ = ds.initialize(model=net_g, model_parameters=net_g.parameters(), config=gan_config(stage))
            parts = (engine_g, engine_d, engine_d.backward, engine_d.step, engine_g.backward, engine_g.step)
        return lambda i: gan_iteration(*parts, *batches[i % len(batches)])
    from examples.demo.model import GPT, preset

    torch.manual_seed(0)
    model = GPT(preset("demo", seq_len=128))
    rank = dist.get_rank() if dist.is_initialized() else 0
    batches = token_batches(model.cfg.vocab_size, 8, 128, 16, rank)
    if library == "torch":
        wrapped = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
        opt = torch.optim.AdamW(model.parameters(), **{**ADAM, "betas": tuple(ADAM["betas"])})

        def plain(i: int) -> None:
            wrapped(*batches[i % len(batches)]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return plain
    ds = _library(library)
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "steps_per_print": 10**9, "optimizer": {"type": "AdamW", "params": ADAM},
              "zero_optimization": {"stage": stage}}
    engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=config)

    def engine_step(i: int) -> None:
        engine.backward(engine(*batches[i % len(batches)]))
        engine.step()

    return engine_step


def _library(name: str) -> Any:
    import torch.distributed as dist

    if name == "deepspeed":
        import deepspeed

        if not dist.is_initialized():
            deepspeed.init_distributed(dist_backend="gloo")
        return deepspeed
    import shardwise

    return shardwise


def _rank_main(rank: int, model_name: str, kind: str, world: int, warmup: int, steps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    library, _, stage = kind.partition("-")
    if library == "torch" and world > 1:
        dist.init_process_group("gloo")
    iteration = _loop(model_name, library, int(stage or 0), world)
    torch.set_num_threads(1)
    walls, cpus = [], []
    for i in range(warmup + steps):
        start, cpu = time.perf_counter(), time.process_time()
        iteration(i)
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
    if dist.is_initialized():
        dist.barrier()
    return {"wall_ms": 1e3 * statistics.median(walls[warmup:]), "cpu_ms": 1e3 * statistics.median(cpus[warmup:])}


def _run_here(model_name: str, kind: str, world: int, warmup: int, steps: int) -> dict[str, Any]:
    ranks = spawn(_rank_main, world, (model_name, kind, world, warmup, steps), timeout=600)
    if isinstance(ranks, dict):
        return ranks
    slowest = max(ranks, key=lambda r: r["wall_ms"])
    return {k: round(v, 4) for k, v in slowest.items()}


def _paired_main(rank: int, model_name: str, stage: int, warmup: int, steps: int) -> dict[str, Any]:
    """The plain loop and shardwise at `stage` in one process, alternating iteration by iteration: both see the
    same machine at the same moment, so their ratio holds on a VM whose speed drifts between processes."""
    import torch

    torch.set_num_threads(1)
    plain, engine = _loop(model_name, "torch", 0, 1), _loop(model_name, "shardwise", stage, 1)
    torch.set_num_threads(1)
    walls = {"torch": [], "shardwise": []}
    for i in range(warmup + steps):
        start = time.perf_counter()
        plain(i)
        middle = time.perf_counter()
        engine(i)
        end = time.perf_counter()
        if i >= warmup:
            walls["torch"].append(middle - start)
            walls["shardwise"].append(end - middle)
    spread = paired_spread(walls["shardwise"], walls["torch"])
    return {"torch_ms": 1e3 * statistics.median(walls["torch"]), "shardwise_ms": 1e3 * statistics.median(walls["shardwise"]),
            "over_torch": spread["median"], "p10": spread["p10"], "p90": spread["p90"]}


def paired(args: argparse.Namespace) -> dict[str, Any]:
    """--paired: world 1 only, each stage against the plain loop in the same process."""
    report: dict[str, Any] = {"benchmark": "engine_overhead_paired", "setup": {
        "warmup": args.warmup, "steps": args.steps, "threads_per_rank": 1, "world": 1, **environment()}, "cells": {}}
    load = LoadSampler()
    rows = [["model", "stage", "torch ms", "shardwise ms", "over torch (p10-p90)"]]
    for model_name in args.models.split(","):
        for stage in [0] + [int(s) for s in args.stages.split(",")]:
            ranks = spawn(_paired_main, 1, (model_name, stage, args.warmup, args.steps), timeout=1800)
            cell = ranks if isinstance(ranks, dict) else {k: round(v, 4) for k, v in ranks[0].items()}
            report["cells"][f"{model_name}-shardwise-{stage}"] = cell
            log(model_name, stage, cell)
            if "error" not in cell:
                rows.append([model_name, stage, cell["torch_ms"], cell["shardwise_ms"],
                             f"{cell['over_torch']} ({cell['p10']}-{cell['p90']})"])
    report["load"] = load.summary()
    write_report(report, args.out or RESULTS / "engine_overhead_paired.json")
    print_columns(rows)
    return report


def _run(args: argparse.Namespace, model_name: str, kind: str, world: int) -> dict[str, Any]:
    """One configuration in fresh processes; DeepSpeed's in the other venv's Python."""
    if not kind.startswith("deepspeed"):
        return _run_here(model_name, kind, world, args.warmup, args.steps)
    command = [args.deepspeed_python, __file__, "--child", json.dumps([model_name, kind, world, args.warmup, args.steps])]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {"error": done.stderr[-2000:]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gan,gpt")
    parser.add_argument("--worlds", default="1,2")
    parser.add_argument("--stages", default="1,2,3", help="DeepSpeed's GAN needs stage >= 1 (its stage 0 refuses "
                                                          "the tutorial's loop); shardwise-0 is added alone")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--deepspeed-python", default=None)
    parser.add_argument("--paired", action="store_true", help="world 1: each stage and the plain loop alternating "
                        "in one process (engine_overhead_paired.json)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="default: results/engine_overhead.json (--paired: "
                        "engine_overhead_paired.json)")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_run_here(*json.loads(args.child))))
        return {}
    if args.paired:
        return paired(args)
    stages = [int(s) for s in args.stages.split(",")]
    kinds = ["torch", "shardwise-0"] + [f"shardwise-{s}" for s in stages]
    if args.deepspeed_python:
        kinds += [f"deepspeed-{s}" for s in stages]
    load = LoadSampler()
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for model_name in args.models.split(","):
        for world in map(int, args.worlds.split(",")):
            cell = results.setdefault(f"{model_name}-world{world}", {k: [] for k in kinds})
            for r in range(args.rounds):
                order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]
                for kind in order if r % 2 == 0 else order[::-1]:
                    cell[kind].append(_run(args, model_name, kind, world))
                    log(model_name, world, kind, cell[kind][-1])
    report: dict[str, Any] = {"benchmark": "engine_overhead", "setup": {"warmup": args.warmup, "steps": args.steps,
                              "rounds": args.rounds, "threads_per_rank": 1, **environment(),
                              "deepspeed_peer": peer_version(args.deepspeed_python) if args.deepspeed_python else "not run"},
                              "cells": {}}
    rows = [["cell", "config", "wall ms", "cpu ms", "over torch", "over deepspeed-S"]]
    for name, cell in results.items():
        out = report["cells"][name] = {}
        for kind, runs in cell.items():
            good = [run for run in runs if "error" not in run]
            if not good:
                out[kind] = {"error": runs[0].get("error") if runs else "not run"}
                continue
            entry = {"wall_ms": statistics.median(r["wall_ms"] for r in good),
                     "cpu_ms": statistics.median(r["cpu_ms"] for r in good)}
            for ref in ("torch", "deepspeed-" + kind.partition("-")[2]):
                pairs = [(a["wall_ms"], b["wall_ms"]) for a, b in zip(runs, cell.get(ref, []))
                         if "error" not in a and "error" not in b]
                if pairs and ref != kind:
                    entry[f"over_{ref.split('-')[0]}"] = paired_ratio(*zip(*pairs))
            out[kind] = {k: round(v, 4) if isinstance(v, float) else v for k, v in entry.items()}
            rows.append([name, kind, out[kind]["wall_ms"], out[kind]["cpu_ms"], out[kind].get("over_torch", ""),
                         out[kind].get("over_deepspeed", "")])
    report["load"] = load.summary()
    write_report(report, args.out or RESULTS / "engine_overhead.json")
    print_columns(rows)
    return report


if __name__ == "__main__":
    main()
