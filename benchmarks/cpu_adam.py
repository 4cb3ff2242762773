"""CPU Adam throughput: parameters updated per second, against the memory-bandwidth limit.

One fp32 parameter of `--numel` elements (100M by default: 400 MB, 1.6 GB with its gradient and the
two moments), one AdamW step at a time (lr 1e-3, betas 0.9/0.999, weight decay 0.01), for:

| optimizer | what runs |
| --- | --- |
| shardwise CPUAdam | `shardwise.optim.adam.CPUAdam` (adamw_mode=True) |
| torch fused | `torch.optim.AdamW(fused=True)` |
| torch foreach | `torch.optim.AdamW(foreach=True)` |
| DeepSpeedCPUAdam | `deepspeed.ops.adam.DeepSpeedCPUAdam` (adamw_mode=True), when importable; its op builds on first use |

Each (optimizer, thread count) runs in its own fresh process with OMP_NUM_THREADS and
torch.set_num_threads set to that count before torch loads (DeepSpeed's op may link an OpenMP runtime
of its own, which only the environment variable reaches). One untimed step creates the state, then
`--steps` timed steps; the figure is the fastest step (and the median beside it).

The limit: an Adam step reads the parameter, gradient and both moments and writes the parameter and
both moments back: 28 bytes per element, every written line one that was just read. Bandwidth is
measured in the same kind of process, on arrays of the same size, with the same access pattern: an
in-place `a.add_(b)` (reads 8 bytes, writes back 4 it has read: 12 bytes per element), best of 10.
Out-of-place `torch.add(a, b, out=c)` and `c.copy_(a)` are reported beside it, counted both with
the write-allocate read of the destination (16 and 12 bytes) and as STREAM counts them (12 and 8).
28 x numel / bandwidth is the fastest possible step; each optimizer's "% of limit" is that time over
its own fastest step.

    .venv/bin/python benchmarks/cpu_adam.py
    DS_ACCELERATOR=cpu PYTHONPATH=src:. .dsvenv/bin/python benchmarks/cpu_adam.py    # + DeepSpeedCPUAdam

Prints the JSON and writes benchmarks/results/cpu_adam.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (
    RESULTS,
    LoadSampler,
    environment,
    has_deepspeed,
    log,
    rss_mib,
    spawn,
    write_report,
)

OPTIMIZERS = ("shardwise CPUAdam", "torch fused", "torch foreach", "DeepSpeedCPUAdam")
HP = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
BYTES_PER_ELEMENT = 28  # read p, g, m, v (16) + write p, m, v (12)


def _make(name: str, params: list[Any]) -> Any:
    import torch

    if name == "shardwise CPUAdam":
        from shardwise.optim.adam import CPUAdam

        return CPUAdam(params, adamw_mode=True, **HP)
    if name == "torch fused":
        return torch.optim.AdamW(params, fused=True, **HP)
    if name == "torch foreach":
        return torch.optim.AdamW(params, foreach=True, **HP)
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(params, adamw_mode=True, **HP)


def _optimizer_main(rank: int, name: str, numel: int, threads: int, steps: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    param = torch.nn.Parameter(torch.randn(numel) * 0.02)
    param.grad = torch.randn(numel) * 1e-3
    optimizer = _make(name, [param])
    torch.set_num_threads(threads)
    optimizer.step()  # creates the moments
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return {"step_s_min": min(times), "step_s_median": statistics.median(times), "threads": torch.get_num_threads(),
            "peak_rss_mib": round(rss_mib(), 1), "class": type(optimizer).__name__}


def _bandwidth_main(rank: int, numel: int, threads: int, reps: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    a, b, c = torch.rand(numel), torch.rand(numel), torch.empty(numel)
    torch.add(a, b, out=c)  # touch every page before timing
    ops = {"add_inplace": lambda: a.add_(b, alpha=1e-9), "add_out": lambda: torch.add(a, b, out=c),
           "copy": lambda: c.copy_(a)}
    best = {name: float("inf") for name in ops}
    for _ in range(reps):
        for name, op in ops.items():
            start = time.perf_counter()
            op()
            best[name] = min(best[name], time.perf_counter() - start)
    # Bytes the memory bus really moves per element: an in-place add reads two arrays and writes one it
    # has just read (12); an out-of-place add and a copy also read the destination line before writing
    # it (write-allocate: 16 and 12). STREAM counts 12 and 8 for the latter two.
    moved = {"add_inplace": 12, "add_out": 16, "copy": 12}
    return {**{f"{name}_gb_s": round(moved[name] * numel / best[name] / 1e9, 2) for name in ops},
            "add_out_gb_s_stream_counting": round(12 * numel / best["add_out"] / 1e9, 2),
            "copy_gb_s_stream_counting": round(8 * numel / best["copy"] / 1e9, 2),
            "threads": torch.get_num_threads()}


def _in_fresh_process(fn: Any, threads: int, args: tuple, timeout: float) -> dict[str, Any]:
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited by the spawned child before torch loads
    try:
        result = spawn(fn, 1, args, timeout)
    finally:
        os.environ["OMP_NUM_THREADS"] = saved or "1"
    return result if isinstance(result, dict) else result[0]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=100_000_000)
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per optimizer")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="subset of: " + ",".join(OPTIMIZERS))
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per process (DeepSpeed's op build included)")
    parser.add_argument("--out", default=str(RESULTS / "cpu_adam.json"))
    args = parser.parse_args(argv)

    load = LoadSampler()
    with_ds = has_deepspeed()
    names = [n for n in args.optimizers.split(",") if n != "DeepSpeedCPUAdam" or with_ds]
    report: dict[str, Any] = {"benchmark": "cpu_adam", "setup": {"numel": args.numel, "dtype": "float32",
                              "timed_steps": args.steps, "hyperparameters": {**HP, "betas": list(HP["betas"])},
                              "bytes_per_element_per_step": BYTES_PER_ELEMENT, **environment()}, "threads": {}}
    if "DeepSpeedCPUAdam" in args.optimizers and not with_ds:
        report["setup"]["DeepSpeedCPUAdam"] = "not installed"
    for threads in (int(t) for t in args.threads.split(",")):
        bw = _in_fresh_process(_bandwidth_main, threads, (args.numel, threads, 10), args.timeout)
        row: dict[str, Any] = {"bandwidth": bw}
        if "error" not in bw:
            bandwidth = bw["add_inplace_gb_s"] * 1e9  # Adam's pattern: read-modify-write, no write-allocate
            limit_s = BYTES_PER_ELEMENT * args.numel / bandwidth
            row["limit"] = {"bandwidth_gb_s": round(bandwidth / 1e9, 2), "step_s": round(limit_s, 4),
                            "params_per_s": round(args.numel / limit_s / 1e9, 3), "unit": "1e9 params/s"}
        log(f"[{threads} thread(s)] bandwidth: {bw}")
        for name in names:
            r = _in_fresh_process(_optimizer_main, threads, (name, args.numel, threads, args.steps), args.timeout)
            if "error" not in r:
                r["giga_params_per_s"] = round(args.numel / r["step_s_min"] / 1e9, 3)
                r["giga_params_per_s_median_step"] = round(args.numel / r["step_s_median"] / 1e9, 3)
                if "limit" in row:
                    r["pct_of_bandwidth_limit"] = round(100 * row["limit"]["step_s"] / r["step_s_min"], 1)
                r["step_s_min"], r["step_s_median"] = round(r["step_s_min"], 4), round(r["step_s_median"], 4)
            row[name] = r
            log(f"[{threads} thread(s)] {name}: {r}")
        sw, ds = row.get("shardwise CPUAdam"), row.get("DeepSpeedCPUAdam")
        if isinstance(sw, dict) and isinstance(ds, dict) and "error" not in sw and "error" not in ds:
            row["shardwise_over_deepspeed_throughput"] = round(sw["giga_params_per_s"] / ds["giga_params_per_s"], 3)
        report["threads"][str(threads)] = row
    report["setup"]["load_average"] = load.summary()
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
