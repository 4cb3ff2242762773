"""Training a LLaMA-shaped model of ~1.3B parameters on one GPU (bf16 compute, fp32 master weights, sequence
2048): a plain PyTorch loop as the floor, shardwise's ZeRO stages 0-3 and ZeRO-3 with optimizer and parameters
offloaded to pinned host memory, and the real DeepSpeed 0.19.8 on the same configs, each in a process of its own,
all in one run so that the figures stand side by side: tokens/s, MFU (against the card's measured bf16 matmul
rate and its spec sheet's peak), peak device memory, and the losses (one seed and one batch for all: the first
losses must agree).

On the device machine (benchmarks/README.md, "Training on one GPU"), with .whl carried:
    make gpu-install && python3 benchmarks/gpu_train.py             # ~3 minutes on an H100
    make gpu-install && python3 benchmarks/gpu_train.py --largest   # its own call, ~8 minutes
Here, end to end at a tiny size on the CPU (DeepSpeed from .dsvenv, `make .dsvenv/.installed`):
    PYTHONPATH=src .venv/bin/python benchmarks/gpu_train.py --tiny --deepspeed-python .dsvenv/bin/python

Writes $OUT/gpu_train.json (gpu_train_largest.json) on the device, else benchmarks/results/gpu/ (--tiny: runs/).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _gpu_train_model import CONFIGS, DEEPSPEED_VERSION, DEFAULT, FLOPS_FORMULA, TINY, spec_tflops  # noqa: E402
from _gpu_train_report import environment, summarize, table, write  # noqa: E402
from _gpu_train_runner import (REPO, Children, OpBuild, deepspeed_site, host_floor_guard, log,  # noqa: E402
                               run_in_turn)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="the tiny model on the CPU: the whole flow, no figures")
    p.add_argument("--largest", action="store_true", help="the largest model ZeRO-3 + CPU offload trains instead")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, in order, of " + ",".join(CONFIGS))
    p.add_argument("--micro", type=int, help="micro-batch (default 4; 2 with --tiny)")
    p.add_argument("--seq", type=int, help="sequence length (default 2048; 64 with --tiny)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per config")
    p.add_argument("--steps", type=int, default=5, help="timed steps per config (offloaded configs: at most 3)")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing in every config")
    p.add_argument("--bf16", choices=("on", "off"), default="on",
                   help="bf16 compute with fp32 masters (on; --tiny too: the CPU runs it), or fp32 throughout")
    p.add_argument("--timeout", type=float, help="seconds a config may run before it is recorded "
                   "as hung (default 90; 300 with --largest)")
    p.add_argument("--budget", type=float, help="seconds for the whole run; configs it leaves no time for are "
                   "recorded as skipped (default 175; 480 with --largest; 900 with --tiny)")
    p.add_argument("--host-floor-gib", type=float, default=4.0,
                   help="kill a child when the host's available memory falls below this")
    p.add_argument("--no-overlap", action="store_true", help="start each child only when the previous one ended")
    p.add_argument("--no-prebuild", action="store_true",
                   help="let the DeepSpeed offload child build its CPU Adam op itself (op_load_seconds)")
    p.add_argument("--deepspeed-optimizer", choices=("torch", "fused"), default="torch",
                   help="DeepSpeed's optimizer when not offloaded: torch's fused AdamW (its torch_adam key, as the "
                        "floor and shardwise run) or its own FusedAdam op (built on first use)")
    p.add_argument("--deepspeed-site", help="folder(s), os.pathsep-separated, the real DeepSpeed imports from "
                   "(default: .whl/peer/'s wheels unpacked into /tmp/ds-site)")
    p.add_argument("--deepspeed-python", help="a Python whose site has the real DeepSpeed (e.g. .dsvenv/bin/python)")
    p.add_argument("--deepspeed-version", default=DEEPSPEED_VERSION, help="what a DeepSpeed child must import")
    p.add_argument("--skip-refused", action="store_true",
                   help="--largest: do not try the rung above the planner's answer (to show it fails cleanly)")
    p.add_argument("--out", help="the JSON's path (default: $OUT/gpu_train.json, else benchmarks/results/gpu/)")
    return p.parse_args(argv)


def base_spec(args: argparse.Namespace) -> dict[str, Any]:
    device = "cpu" if args.tiny else "cuda"
    bf16 = args.bf16 == "on"
    return {"device": device, "micro": args.micro or (2 if args.tiny else 4), "seq": args.seq or (64 if args.tiny
            else 2048), "warmup": args.warmup, "bf16": bf16, "checkpointing": args.checkpointing,
            "deepspeed_optimizer": args.deepspeed_optimizer, "deepspeed_version": args.deepspeed_version}


def setup(args: argparse.Namespace) -> tuple[Children, dict[str, Any], float]:
    started = time.monotonic()
    budget = args.budget or (480.0 if args.largest else 900.0 if args.tiny else 175.0)
    site = deepspeed_site(args.deepspeed_site, args.deepspeed_python, Path("/tmp/ds-site"))
    logs = REPO / "runs" / "gpu_train" / f"logs-{time.strftime('%Y%m%d-%H%M%S')}"
    children = Children(site, args.deepspeed_python, logs)
    log(f"budget {budget:.0f}s; DeepSpeed: {site or args.deepspeed_python or 'not available'}; child logs in {logs}")
    if importlib.util.find_spec("pydantic") is None:  # shardwise's one need beyond torch
        log("pydantic is not importable: shardwise's children will fail; run `make gpu-install` first")
    return children, {"budget_seconds": budget, "deepspeed_from": site or args.deepspeed_python,
                      "child_logs": str(logs)}, started + budget


def train_configs(args: argparse.Namespace, children: Children, spec: dict[str, Any], deadline: float
                  ) -> dict[str, Any]:
    shape = TINY if args.tiny else DEFAULT
    configs = args.configs.split(",")
    build = OpBuild(children, spec, not args.no_prebuild and any(c.startswith("deepspeed") and "offload" in c
                                                                 for c in configs))

    def spec_of(config: str) -> dict[str, Any]:
        steps = min(args.steps, 3) if "offload" in config else args.steps  # CPU Adam: seconds per step
        return {**spec, "shape": shape.to_json(), "steps": steps}

    def before(config: str) -> None:
        if "offload" in config:  # the op's compile must not share the host's cores with either CPU Adam
            build.wait(deadline)

    def timeout_of(config: str) -> float:  # the probe (a CUDA start and 13 products) gets a minute whatever
        return max(args.timeout, 60.0) if config == "probe" else args.timeout

    results = run_in_turn(children, ["probe", *configs], spec_of, timeout_of, deadline, not args.no_overlap,
                          before, (host_floor_guard(int(args.host_floor_gib * 2**30)),))
    probe = results.pop(0)
    if probe["status"] != "ok":  # no device: nothing below means anything
        return {"probe": probe, "results": results, "deepspeed_op_build": build.close()}
    report = head(args, probe, spec) | {"deepspeed_op_build": build.close()}
    report.update(summarize(results, shape, spec, probe["matmul_tflops"], report["spec_tflops"]), results=results)
    for row in table(results):
        log(row)
    return report


def head(args: argparse.Namespace, probe: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """What the figures are of: the machine, the commit, the model, the run's settings, the rates MFU uses."""
    shape = TINY if args.tiny else DEFAULT
    report = {**environment(probe), "shape": shape.to_json(), "spec": spec, "flops_formula": FLOPS_FORMULA,
              "matmul_tflops_measured": float(f"{probe['matmul_tflops']:.4g}"),
              "matmul": f"{probe['matmul_size']}^3 {probe['matmul_dtype']}",
              "spec_tflops": spec_tflops(probe["device"]) if spec["bf16"] else None, "overlap": not args.no_overlap}
    if not spec["bf16"]:
        report["precision_note"] = "fp32 compute (--bf16 off): MFU is against the measured fp32 matmul rate"
    if args.tiny:
        report["tiny_note"] = ("--tiny: the CPU with gloo, bf16 modules and bf16 autocast on the CPU as on the "
                               "GPU; it proves the flow, its figures measure nothing")
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.timeout = args.timeout or (300.0 if args.largest else 90.0)
    children, facts, deadline = setup(args)
    spec = base_spec(args)
    report: dict[str, Any] = {"benchmark": "gpu_train_largest" if args.largest else "gpu_train", "tiny": args.tiny,
                              **facts}
    if args.largest:
        from _gpu_train_largest import largest

        report.update(largest(children, spec, args, deadline))
    else:
        report.update(train_configs(args, children, spec, deadline))
    path = write(report, report["benchmark"], args.tiny, args.out)
    log(f"wrote {path}")
    print(json.dumps(report, indent=1))
    return 0 if "probe" not in report else 1


if __name__ == "__main__":
    sys.exit(main())
