"""Training a LLaMA-shaped model of ~1.3B parameters on one GPU (bf16 compute, fp32 master weights, sequence
2048): a plain PyTorch loop as the floor, shardwise's ZeRO stages 0-3 and ZeRO-3 with optimizer and parameters
offloaded to pinned host memory, and the real DeepSpeed 0.19.8 on the same configs, each in a process of its own,
all in one run so that the figures stand side by side: tokens/s, MFU (against the card's measured bf16 matmul
rate and its spec sheet's peak), peak device memory, and the losses (one seed and one batch for all: the first
losses must agree).

On the device machine (README, "The device suite"), after `make test-gpu` installed shardwise:
    python3 benchmarks/gpu_train.py                 # ~3 minutes on an H100; DeepSpeed from .whl/peer/
    python3 benchmarks/gpu_train.py --largest       # the largest model ZeRO-3 + CPU offload trains, both libraries
Here, end to end at a tiny size on the CPU (DeepSpeed from .dsvenv, `make .dsvenv/.installed`):
    PYTHONPATH=src python benchmarks/gpu_train.py --tiny --deepspeed-python .dsvenv/bin/python

Writes $OUT/gpu_train.json (gpu_train_largest.json) on the device, else benchmarks/results/gpu/ (--tiny: runs/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from _gpu_train_model import CONFIGS, DEFAULT, FLOPS_FORMULA, TINY, Shape, spec_tflops  # noqa: E402


def log(message: str) -> None:
    print(f"[gpu_train {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("SHARDWISE_COMMIT", "unknown (no .git here and SHARDWISE_COMMIT unset)")


def environment(device: str) -> dict[str, Any]:
    import torch

    return {"commit": commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
            "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "cpus": os.cpu_count()}


def matmul_tflops(device: str, size: int) -> float:
    """The card's sustained bf16 matmul rate: the median of ten size^3 products after three warm-ups."""
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    times = []
    for i in range(13):
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return 2 * size**3 / statistics.median(times[3:]) / 1e12


class Children:
    """Starts one child per configuration with the path its library needs, under a deadline."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.deepspeed_site = deepspeed_site(args)

    def command(self, config: str, spec: dict[str, Any]) -> tuple[list[str], dict[str, str]] | str:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        python = sys.executable
        if config.startswith("deepspeed"):
            if self.deepspeed_site is None and not self.args.deepspeed_python:
                return "DeepSpeed is not available: no .whl/peer/ wheels, --deepspeed-site or --deepspeed-python"
            python = self.args.deepspeed_python or python
            paths = [self.deepspeed_site] if self.deepspeed_site else []
            if spec["device"] == "cpu":
                env["DS_ACCELERATOR"] = "cpu"
        else:
            paths = [str(REPO / "src")]  # this tree's shardwise, whatever else is installed
        env["PYTHONPATH"] = os.pathsep.join([*paths, str(HERE)])
        return [python, str(HERE / "_gpu_train_child.py"), json.dumps(spec)], env

    def run(self, config: str, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
        command = self.command(config, {**spec, "config": config, "port": free_port()})
        if isinstance(command, str):
            return {"config": config, "status": "skipped", "reason": command}
        argv, env = command
        started = time.perf_counter()
        try:
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
        except subprocess.TimeoutExpired as e:
            tail = (e.stderr or b"")[-3000:]
            return {"config": config, "status": "timeout", "seconds": timeout,
                    "stderr_tail": tail.decode(errors="replace") if isinstance(tail, bytes) else tail}
        wall = round(time.perf_counter() - started, 1)
        result = next((json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
        if done.returncode or result is None:
            return {"config": config, "status": "failed", "returncode": done.returncode, "process_seconds": wall,
                    "stderr_tail": done.stderr[-3000:]}
        return {**result, "status": "ok", "process_seconds": wall}


def deepspeed_site(args: argparse.Namespace) -> str | None:
    """Where the real DeepSpeed is importable from: --deepspeed-site, or .whl/peer/'s wheels unpacked once."""
    if args.deepspeed_site:
        return args.deepspeed_site
    wheels = sorted((REPO / ".whl" / "peer").glob("*.whl"))
    if not wheels or args.deepspeed_python:
        return None
    target = Path("/tmp/shardwise-deepspeed-site")
    if not (target / "deepspeed").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                        str(target), *map(str, wheels)], check=True)
    return str(target)


def summarize(results: list[dict[str, Any]], shape: Shape, spec: dict[str, Any], measured: float,
              peak: float | None) -> None:
    """Adds tokens/s, MFU and the ratios to each result in place."""
    tokens = spec["micro"] * spec["seq"]
    flops = shape.flops_per_token(spec["seq"]) * tokens
    by_name = {r["config"]: r for r in results if r["status"] == "ok"}
    for r in by_name.values():
        median = statistics.median(r["step_seconds"])
        r.update(median_step_seconds=round(median, 4), spread=[round(min(r["step_seconds"]), 4),
                 round(max(r["step_seconds"]), 4)], tokens_per_second=round(tokens / median, 1),
                 mfu_measured=round(flops / median / (measured * 1e12), 4),
                 mfu_spec=round(flops / median / (peak * 1e12), 4) if peak else None)
    floor = by_name.get("floor")
    for name, r in by_name.items():
        if floor and name != "floor":
            r["throughput_vs_floor"] = round(r["tokens_per_second"] / floor["tokens_per_second"], 3)
            r["first_loss_vs_floor"] = round(r["losses"][0] / floor["losses"][0] - 1, 5)
        peer = by_name.get(name.replace("shardwise", "deepspeed")) if name.startswith("shardwise") else None
        if peer:
            r["throughput_vs_deepspeed"] = round(r["tokens_per_second"] / peer["tokens_per_second"], 3)
            r["peak_memory_vs_deepspeed"] = round(r["peak_device_bytes"] / peer["peak_device_bytes"], 3)


def write(report: dict[str, Any], name: str, tiny: bool) -> Path:
    """$OUT on the device machine; else results/gpu/ (a --tiny run's figures are no result: runs/, ignored)."""
    here = REPO / "runs" / "gpu_train" if tiny else REPO / "benchmarks" / "results" / "gpu"
    folder = Path(os.environ["OUT"]) if os.environ.get("OUT") else here
    folder.mkdir(parents=True, exist_ok=True)
    stamp = "" if os.environ.get("OUT") else "-" + time.strftime("%Y%m%d-%H%M%S")
    path = folder / f"{name}{stamp}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a tiny model on this machine's device (the CPU here)")
    p.add_argument("--largest", action="store_true", help="the largest ZeRO-3 + CPU offload model instead")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ",".join(CONFIGS))
    p.add_argument("--micro", type=int, default=None, help="micro-batch (default 4; 2 with --tiny)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 2048; 64 with --tiny)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="timed steps per config (offloaded configs: 3)")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing in every config")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds per config before it is recorded as hung")
    p.add_argument("--budget", type=float, help="seconds for the whole run, after which the configs left are skipped "
                   "(default 210; 480 with --largest)")
    p.add_argument("--deepspeed-optimizer", choices=("torch", "fused"), default="torch",
                   help="DeepSpeed's optimizer when not offloaded: torch's fused AdamW (as the floor and shardwise) "
                        "or its own FusedAdam op (built on first use)")
    p.add_argument("--deepspeed-site", help="a folder the real DeepSpeed imports from (default: .whl/peer/ unpacked)")
    p.add_argument("--deepspeed-python", help="a Python whose site has the real DeepSpeed (e.g. .dsvenv/bin/python)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    spec = {"device": device, "micro": args.micro or (2 if args.tiny else 4), "seq": args.seq or (64 if args.tiny else 2048),
            "warmup": args.warmup, "bf16": device == "cuda", "checkpointing": args.checkpointing,
            "deepspeed_optimizer": args.deepspeed_optimizer}
    report: dict[str, Any] = {"benchmark": "gpu_train", **environment(device), "flops_formula": FLOPS_FORMULA}
    children = Children(args)
    if args.largest:
        from _gpu_train_largest import largest

        report.update(largest(children, spec, tiny=args.tiny, budget=args.budget or 480.0))
        log(f"wrote {write(report, 'gpu_train_largest', args.tiny)}")
        print(json.dumps(report, indent=1))
        return
    shape = TINY if args.tiny else DEFAULT
    measured = matmul_tflops(device, 1024 if device == "cpu" else 8192)
    peak = spec_tflops(report["device"])
    report.update(shape=shape.to_json(), spec=spec, matmul_tflops_measured=round(measured, 1), spec_tflops=peak,
                  bf16_note=None if spec["bf16"] else "fp32 on the CPU: bf16 autocast on the CPU is not what is measured")
    log(f"{report['device']}: matmul {measured:.3g} TFLOP/s measured, spec {peak}; {shape.parameters / 1e9:.2f}B parameters")
    results: list[dict[str, Any]] = []
    started, budget = time.perf_counter(), args.budget or 210.0
    for config in args.configs.split(","):
        left = budget - (time.perf_counter() - started)
        if left < 20:
            results.append({"config": config, "status": "skipped", "reason": f"the budget of {budget:.0f}s is spent"})
            continue
        steps = min(args.steps, 3) if "offload" in config else args.steps
        result = children.run(config, {**spec, "shape": shape.to_json(), "steps": steps}, min(args.timeout, left))
        log(f"{config}: {result['status']} "
            + (f"median step {statistics.median(result['step_seconds']):.3f}s, losses {result['losses'][0]:.4f}.."
               f"{result['losses'][-1]:.4f}" if result["status"] == "ok" else result.get("reason", result.get("stderr_tail", ""))[-300:]))
        results.append(result)
    summarize(results, shape, spec, measured, peak)
    report["results"] = results
    log(f"wrote {write(report, 'gpu_train', args.tiny)}")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
