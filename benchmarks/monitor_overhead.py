"""What each observability switch costs in step time: world size 2 on CPU.

The demo GPT (examples/demo/model.py, 1.85M parameters) at a small micro-batch, one engine per switch
setting, all built in one pair of forked gloo ranks (one intra-op thread each). Rounds interleave the
settings (K steps of each in turn, the order rotated every round) so that they see the same machine state. Two figures per setting:
the CPU time per step (the process's, mean of the ranks; median over rounds), which the overheads are
computed from because it is what instrumentation adds and it barely moves when other jobs share the
machine, and the wall time per step (the slower rank's; the fastest round), which does move with load.
Two independent engines with everything off give the noise floor. `steps_per_print` is 10
(DeepSpeed's default) for every setting.

Also measured: the cost of the instrumentation calls themselves with every switch off (the engine's
four contexts per micro-step, timed in a tight loop), and the one-off cost of the flops profiler's
profiled step.

    .venv/bin/python benchmarks/monitor_overhead.py [--rounds 20 --steps 3]

Prints the JSON and writes it to benchmarks/results/monitor_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
for path in (REPO_ROOT, REPO_ROOT / "src"):
    if str(path) not in sys.path:
        sys.path.append(str(path))
os.environ.setdefault("OMP_NUM_THREADS", "1")

WORLD, MICRO, SEQ_LEN, PROFILE_STEP = 2, 4, 64, 1
PROFILER = "flops_profiler (steps after the profiled one)"


def settings(out_dir: str) -> dict[str, dict[str, Any]]:
    files = {"output_path": out_dir, "job_name": "bench"}
    return {
        "off": {},
        "off (second engine: noise floor)": {},
        "wall_clock_breakdown": {"wall_clock_breakdown": True},
        "comms_logger": {"comms_logger": {"enabled": True}},
        "wall_clock_breakdown + comms_logger": {"wall_clock_breakdown": True, "comms_logger": {"enabled": True}},
        "csv_monitor + tensorboard": {"csv_monitor": {"enabled": True, **files}, "tensorboard": {"enabled": True, **files}},
        PROFILER: {"flops_profiler": {"enabled": True, "profile_step": PROFILE_STEP,
                                                                             "output_file": f"{out_dir}/flops.txt"}},
        "memory_breakdown": {"memory_breakdown": True},
    }


def _config(extra: dict[str, Any]) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "steps_per_print": 10,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}}, **extra}


def _rank_main(out_dir: str, rounds: int, steps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import shardwise
    from examples.demo.model import GPT, preset

    engines, batches = {}, []
    for name, extra in settings(out_dir).items():
        torch.manual_seed(0)
        model = GPT(preset("demo", seq_len=SEQ_LEN))
        engines[name], *_ = shardwise.initialize(model=model, model_parameters=model.param_groups(), config=_config(extra))
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        tokens = torch.randint(0, 256, (MICRO, SEQ_LEN + 1), generator=g)
        batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))

    def run(engine: Any, count: int) -> tuple[float, float]:
        """(wall, cpu) seconds per step: the slower rank's wall time, the ranks' mean process CPU time."""
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        for i in range(count):
            x, y = batches[i % len(batches)]
            engine.backward(engine(x, y))
            engine.step()
        wall = torch.tensor([(time.perf_counter() - start) / count])
        cpu = torch.tensor([(time.process_time() - cpu_start) / count / WORLD])
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        dist.all_reduce(cpu)
        return float(wall), float(cpu)

    warm = {name: [run(engine, 1) for _ in range(PROFILE_STEP + 1)] for name, engine in engines.items()}
    profiled_step = warm[PROFILER][PROFILE_STEP]
    per_round: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    names = list(engines)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:  # rotate: no setting always goes first
            per_round[name].append(run(engines[name], steps))
    off_path_s = _off_path_cost(engines["off"])
    return {"per_round": per_round, "profiled_step": profiled_step, "off_path_s_per_micro_step": off_path_s}


def _off_path_cost(engine: Any, n: int = 20000) -> float:
    """Seconds per micro-step of the engine's instrumentation calls with every switch off."""
    inst, module = engine.instruments, engine.module
    start = time.perf_counter()
    for _ in range(n):
        with inst.forward(module, 10**9):
            pass
        with inst.backward():
            with inst.reduce():
                pass
        with inst.step(False):
            pass
    return (time.perf_counter() - start) / n


def summarize(result: dict[str, Any], rounds: int, steps: int) -> dict[str, Any]:
    cpu = {name: statistics.median(c for _, c in times) for name, times in result["per_round"].items()}
    wall = {name: min(w for w, _ in times) for name, times in result["per_round"].items()}
    base = cpu["off"]
    return {
        "benchmark": "monitor_overhead",
        "what": "step time (forward + backward + step, slower rank) with each observability switch, vs all off",
        "world_size": WORLD, "device": "cpu (gloo, 1 thread per rank)", "host": platform.node(),
        "model": f"demo GPT 1.85M params, micro-batch {MICRO} x {SEQ_LEN} tokens, AdamW, ZeRO stage 0",
        "rounds": rounds, "steps_per_round": steps,
        "cpu_ms_per_step": {name: round(m * 1e3, 3) for name, m in cpu.items()},
        "wall_ms_per_step_fastest_round": {name: round(m * 1e3, 3) for name, m in wall.items()},
        "overhead_pct_cpu": {name: round((m / base - 1) * 100, 2) for name, m in cpu.items() if name != "off"},
        "overhead_pct_wall": {name: round((m / wall["off"] - 1) * 100, 2) for name, m in wall.items() if name != "off"},
        "off_path_us_per_micro_step": round(result["off_path_s_per_micro_step"] * 1e6, 2),
        "off_path_pct_of_step": round(result["off_path_s_per_micro_step"] / wall["off"] * 100, 4),
        "flops_profiled_step_cpu_ms": round(result["profiled_step"][1] * 1e3, 2),
        "flops_profiled_step_cpu_vs_median_step": round(result["profiled_step"][1] / cpu[PROFILER], 2),
        "target": "< 2% with wall_clock_breakdown and comms_logger on; 0% with them off",
        "note": "differences within the noise floor (the second all-off engine) are not overheads",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--output", default=str(REPO_ROOT / "benchmarks" / "results" / "monitor_overhead.json"))
    args = parser.parse_args()
    from tests.harness import run_distributed

    with tempfile.TemporaryDirectory() as out_dir:
        result = run_distributed(_rank_main, WORLD, out_dir, args.rounds, args.steps, timeout=1800)[0]
    from _harness import source_state

    summary = {**summarize(result, args.rounds, args.steps), "shardwise_source": source_state()}
    text = json.dumps(summary, indent=2)
    print(text)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(text + "\n")


if __name__ == "__main__":
    main()
