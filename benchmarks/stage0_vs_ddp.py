"""Stage 0 (plain data parallelism) against PyTorch DDP and DeepSpeed: step time and peak memory.

World size 2 on CPU (gloo, one intra-op thread per rank), the demo GPT (examples/demo/model.py), the
same AdamW (fused torch kernel for shardwise and DDP; DeepSpeed's own default Adam kernel), no
gradient clipping, no accumulation. Every configuration runs in its own fresh pair of spawned
processes; the configurations of one preset run back to back in one invocation, so they see the
same machine state. Per step we take the slower rank's wall time (forward + backward + step); the
reported figure is the median over the timed steps. Peak RSS is each rank's `ru_maxrss` at the end,
so it includes what the library import itself costs (reported separately as `rss_mib_after_import`).

    .venv/bin/python benchmarks/stage0_vs_ddp.py                 # shardwise and DDP
    DS_ACCELERATOR=cpu PYTHONPATH=src .dsvenv/bin/python benchmarks/stage0_vs_ddp.py   # + DeepSpeed

Prints the JSON and writes it to benchmarks/results/stage0_vs_ddp.json (see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
for path in (REPO_ROOT, REPO_ROOT / "src"):  # run as a path, with or without shardwise installed
    if str(path) not in sys.path:
        sys.path.append(str(path))

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported, here and in the children
os.environ.setdefault("DS_ACCELERATOR", "cpu")

WORLD = 2
CONFIGS = ("shardwise", "ddp", "deepspeed")
ADAMW = {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _batches(vocab: int, micro: int, seq_len: int, count: int, rank: int) -> list[tuple[Any, Any]]:
    import torch

    g = torch.Generator().manual_seed(1234 + rank)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, vocab, (micro, seq_len + 1), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def _build(kind: str, model: Any, micro: int) -> tuple[Any, Any]:
    """(train_step callable, engine-or-module) for one configuration; the step returns nothing."""
    import torch
    import torch.distributed as dist

    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # DeepSpeed 0.19 would clip at 1.0 by default
        "steps_per_print": 1_000_000,
        "optimizer": {"type": "AdamW", "params": ADAMW},
        "zero_optimization": {"stage": 0},
    }
    if kind == "ddp":
        dist.init_process_group("gloo")
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.param_groups(), **{**ADAMW, "betas": tuple(ADAMW["betas"])}, fused=True)

        def ddp_step(x: Any, y: Any) -> None:
            loss = ddp(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return ddp_step, ddp
    if kind == "deepspeed":
        import deepspeed as ds

        ds.init_distributed(dist_backend="gloo")
    else:
        import shardwise as ds
    engine, _, _, _ = ds.initialize(model=model, model_parameters=model.param_groups(), config=config)

    def engine_step(x: Any, y: Any) -> None:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()

    return engine_step, engine


def _rank_main(rank: int, kind: str, preset_name: str, seq_len: int, micro: int, warmup: int, steps: int,
               port: int, results: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if kind == "deepspeed":
            import deepspeed  # noqa: F401  - counted in the import RSS, like shardwise's import below
        elif kind == "shardwise":
            import shardwise  # noqa: F401
        from examples.demo.model import GPT, preset

        rss_after_import = _rss_mib()
        torch.manual_seed(0)
        model = GPT(preset(preset_name, seq_len=seq_len))
        batches = _batches(model.cfg.vocab_size, micro, seq_len, warmup + steps, rank)
        train_step, _ = _build(kind, model, micro)
        torch.set_num_threads(1)  # whatever the library chose at init, one thread per rank here
        times, cpu_times = [], []
        for x, y in batches:
            start, cpu_start = time.perf_counter(), time.process_time()
            train_step(x, y)
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
        dist.barrier()
        results.put((rank, {"step_times_s": times[warmup:], "cpu_times_s": cpu_times[warmup:], "peak_rss_mib": _rss_mib(),
                            "rss_mib_after_import": rss_after_import, "threads": torch.get_num_threads(),
                            "parameters": model.num_parameters()}))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - the parent must hear about it instead of hanging
        import traceback

        results.put((rank, {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(kind: str, args: argparse.Namespace, preset_name: str) -> dict[str, Any]:
    """One configuration in a fresh pair of processes."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, kind, preset_name, args.seq_len, args.micro_batch,
                                                  args.warmup, args.steps, port, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    per_rank: dict[int, dict[str, Any]] = {}
    try:
        while len(per_rank) < WORLD:
            rank, value = results.get(timeout=args.timeout)
            per_rank[rank] = value
            if "error" in value:
                break
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = {r: v["error"] for r, v in per_rank.items() if "error" in v}
    if errors:
        return {"error": errors}
    ranks = [per_rank[r] for r in range(WORLD)]
    return {
        # a step ends when both ranks are done: the slower rank's time, step by step
        "step_times_s": [max(ts) for ts in zip(*(r["step_times_s"] for r in ranks))],
        "cpu_times_s": [max(ts) for ts in zip(*(r["cpu_times_s"] for r in ranks))],
        "peak_rss_mib_per_rank": [r["peak_rss_mib"] for r in ranks],
        "rss_mib_after_import": [r["rss_mib_after_import"] for r in ranks],
        "threads_per_rank": ranks[0]["threads"],
        "parameters": ranks[0]["parameters"],
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Pool a configuration's rounds: medians over every timed step, the largest RSS seen per rank."""
    if any("error" in r for r in runs):
        return {"error": [r["error"] for r in runs if "error" in r]}
    steps = [t for r in runs for t in r["step_times_s"]]
    cpu = [t for r in runs for t in r["cpu_times_s"]]
    return {
        "step_time_s_median": round(statistics.median(steps), 4),
        "step_time_s_min": round(min(steps), 4),
        "step_time_s_median_per_round": [round(statistics.median(r["step_times_s"]), 4) for r in runs],
        "cpu_time_s_median": round(statistics.median(cpu), 4),
        "peak_rss_mib_per_rank": [round(max(r["peak_rss_mib_per_rank"][i] for r in runs), 1) for i in range(WORLD)],
        "rss_mib_after_import_per_rank": [round(max(r["rss_mib_after_import"][i] for r in runs), 1) for i in range(WORLD)],
        "threads_per_rank": runs[0]["threads_per_rank"],
        "parameters": runs[0]["parameters"],
    }


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None, key: str) -> float | None:
    if not a or not b or key not in a or key not in b:
        return None
    if isinstance(a[key], list):
        return round(max(a[key]) / max(b[key]), 3)
    return round(a[key] / b[key], 3)


def _source_state() -> dict[str, Any]:
    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "--short", "HEAD"), "src_dirty": bool(git("status", "--porcelain", "src"))}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="demo,bench33m", help="comma-separated presets of examples/demo/model.py")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps after the warm-up")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="subset of " + ",".join(CONFIGS))
    parser.add_argument("--rounds", type=int, default=3,
                        help="run every configuration this many times, in reversed order every other round, "
                             "so slow drifts in machine load hit all of them alike")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for a rank's result")
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "stage0_vs_ddp.json"))
    args = parser.parse_args(argv)

    import torch

    has_deepspeed = importlib.util.find_spec("deepspeed") is not None
    report: dict[str, Any] = {
        "setup": {"world_size": WORLD, "device": "cpu", "backend": "gloo", "seq_len": args.seq_len,
                  "micro_batch": args.micro_batch, "warmup_steps": args.warmup, "timed_steps": args.steps,
                  "rounds": args.rounds, "load_average_at_start": os.getloadavg(),
                  "optimizer": {"type": "AdamW", **ADAMW}, "torch": torch.__version__,
                  "python": platform.python_version(), "cpu_count": os.cpu_count(), "shardwise_source": _source_state()},
        "presets": {},
    }
    if has_deepspeed:
        report["setup"]["deepspeed"] = importlib.metadata.version("deepspeed")
    for preset_name in args.presets.split(","):
        kinds = [k for k in args.configs.split(",") if k != "deepspeed" or has_deepspeed]
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
        for round_index in range(args.rounds):
            for kind in kinds if round_index % 2 == 0 else kinds[::-1]:
                runs[kind].append(run_config(kind, args, preset_name))
                last = runs[kind][-1]
                shown = statistics.median(last["step_times_s"]) if "step_times_s" in last else last
                print(f"[{preset_name} round {round_index}] {kind}: {shown}", file=sys.stderr, flush=True)
        rows: dict[str, Any] = {k: summarize(v) for k, v in runs.items()}
        if "deepspeed" in args.configs.split(",") and not has_deepspeed:
            rows["deepspeed"] = "not installed"
        sw, ddp, ds = (rows.get(k) if isinstance(rows.get(k), dict) else None for k in CONFIGS)
        rows["ratios"] = {
            "step_time_shardwise_over_ddp": _ratio(sw, ddp, "step_time_s_median"),
            "step_time_shardwise_over_deepspeed": _ratio(sw, ds, "step_time_s_median"),
            "fastest_step_shardwise_over_ddp": _ratio(sw, ddp, "step_time_s_min"),
            "fastest_step_shardwise_over_deepspeed": _ratio(sw, ds, "step_time_s_min"),
            "cpu_time_shardwise_over_ddp": _ratio(sw, ddp, "cpu_time_s_median"),
            "cpu_time_shardwise_over_deepspeed": _ratio(sw, ds, "cpu_time_s_median"),
            "peak_rss_shardwise_over_ddp": _ratio(sw, ddp, "peak_rss_mib_per_rank"),
            "peak_rss_shardwise_over_deepspeed": _ratio(sw, ds, "peak_rss_mib_per_rank"),
        }
        report["presets"][preset_name] = rows
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
