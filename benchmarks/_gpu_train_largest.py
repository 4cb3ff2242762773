"""benchmarks/gpu_train.py --largest: the largest LLaMA-shaped model that trains with ZeRO-3 and optimizer and
parameters offloaded to pinned host memory on the one GPU, for shardwise and for DeepSpeed.

shardwise's memory planner predicts it: each rung of the ladder is planned (device and host parts) against the
card's memory and the host's available memory, the largest rung that fits both (at 90%, the planner's own margin)
is trained for two steps (stepping down if it fails: the planner was optimistic), the rung above is recorded
with the planner's refusal and, time permitting, tried to show that it fails cleanly. DeepSpeed has no planner, so
it is tried rung by rung from shardwise's answer: up while it trains, down while it fails. Every rung builds its
model in bf16 on the device (the host then holds only what the engine offloads) with activation checkpointing
and a micro-batch of one: the size of the model, not of the batch, is what is measured.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from _gpu_train_model import LADDER, TINY_LADDER, Shape, hf_config, library_config
from _gpu_train_report import environment
from _gpu_train_runner import REPO, Children, Guard, OpBuild, describe, host_floor_guard, log

FIT_SHARE = 0.9
TINY_CAPACITY = {"device": 128 * 2**20, "host": 300 * 2**20}
TINY_OVERHEAD = 128 * 2**20
"""--tiny on the CPU: pretend capacities that cut the tiny ladder in its middle. The children enforce their sum
plus TINY_OVERHEAD (what a process allocates whatever the model: gloo, the first batches, DeepSpeed's op) on their
own growth (_gpu_train_child._cap_memory), so that the failing branches run too."""
REFUSED_MIN_LEFT = 120.0
"""Seconds the run must have left to try the rung the planner refused (on the device: pinning ~100 GiB of host
memory before failing takes a minute or more)."""


def size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


def planned_activations(shape: Shape, micro: int, seq: int) -> Any:
    """With activation checkpointing each layer keeps its bf16 input, one layer at a time is recomputed whole
    (~34 bytes per token and hidden unit under flash attention: Korthikanti et al. 2022, table 2, without the
    attention-score term), and the logits live in bf16, in fp32 for the loss and as the fp32 gradient."""
    from shardwise.planner.shape import ActivationProfile

    tokens = micro * seq
    saved = tokens * shape.hidden * (2 * shape.layers + 34) + tokens * shape.vocab * (2 + 4 + 4)
    return ActivationProfile(saved_bytes=saved, micro_batch=micro, seq_len=seq, compute_bytes=2)


def model_shape(shape: Shape, seq: int) -> Any:
    import torch
    from transformers import LlamaForCausalLM

    from shardwise.planner.shape import ModelShape

    with torch.device("meta"):  # the shape without a byte of memory
        return ModelShape.of(LlamaForCausalLM(hf_config(shape, seq)))


def capacities(probe: dict[str, Any], tiny: bool) -> dict[str, Any]:
    import torch

    from shardwise.accelerator import memory_headroom

    if tiny:
        return {**TINY_CAPACITY, "host_bound_by": "pretend (--tiny)"}
    host = memory_headroom(torch.device("cpu"))  # MemAvailable, or the cgroup's limit where tighter
    return {"device": probe["device_memory_bytes"], "host": host.bytes, "host_bound_by": host.bound_by}


def plan_ladder(ladder: tuple[Shape, ...], spec: dict[str, Any], capacity: dict[str, Any]) -> list[dict[str, Any]]:
    from shardwise.planner.plan import plan

    config = library_config("shardwise-3-offload", spec["micro"], spec["bf16"])
    rows = []
    for shape in ladder:
        memory = plan(model_shape(shape, spec["seq"]), config, 1,
                      planned_activations(shape, spec["micro"], spec["seq"]), spec["seq"])
        over = [f"{where} {size(getattr(memory, 'peak_' + where))} > {FIT_SHARE:.0%} of {size(capacity[where])}"
                for where in ("device", "host") if getattr(memory, "peak_" + where) > FIT_SHARE * capacity[where]]
        rows.append({"shape": shape.to_json(), "planned_device_bytes": memory.peak_device,
                     "planned_host_bytes": memory.peak_host, "fits": not over, "refused_because": over or None})
        log(f"plan {shape.name} ({shape.parameters / 1e6:.1f}M): device {size(memory.peak_device)}, host "
            f"{size(memory.peak_host)}: {'fits' if not over else 'refused: ' + '; '.join(over)}")
    return rows


class Ladder:
    """Two-step runs of one library's ZeRO-3 + offload config at rungs of the ladder."""

    def __init__(self, children: Children, ladder: tuple[Shape, ...], spec: dict[str, Any], timeout: float,
                 deadline: float, guards: tuple[Guard, ...]):
        self.children, self.ladder, self.spec = children, ladder, spec
        self.timeout, self.deadline, self.guards = timeout, deadline, guards

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def attempt(self, library: str, index: int) -> dict[str, Any]:
        shape = self.ladder[index]
        result = self.children.run(f"{library}-3-offload", {**self.spec, "shape": shape.to_json()},
                                   min(self.timeout, self.left()), self.guards)
        keep = ("status", "reason", "returncode", "stderr_tail", "losses", "step_seconds", "peak_memory_bytes",
                "peak_host_bytes", "init_seconds", "op_load_seconds", "optimizer", "version", "seconds")
        log(f"{library} {shape.name}: {describe(result)}")
        return {"shape": shape.name, "parameters": shape.parameters, **{k: result[k] for k in keep if k in result}}

    def walk(self, library: str, start: int, down_only: bool = False) -> list[dict[str, Any]]:
        """From `start`: up while it trains (unless `down_only`), down while it fails, while time is left."""
        tried: list[dict[str, Any]] = []
        index, direction = start, -1 if down_only else 0
        while 0 <= index < len(self.ladder) and self.left() > 20:
            tried.append(self.attempt(library, index))
            ok = tried[-1]["status"] == "ok"
            if tried[-1]["status"] == "skipped" or (direction == 1 and not ok) or (direction == -1 and ok):
                break
            direction = direction or (1 if ok else -1)
            index += direction
        return tried


def _largest_ok(tried: list[dict[str, Any]]) -> str | None:
    ok = [t for t in tried if t["status"] == "ok"]
    return max(ok, key=lambda t: t["parameters"])["shape"] if ok else None


def largest(children: Children, spec: dict[str, Any], args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    sys.path.insert(0, str(REPO / "src"))  # the planner of this tree, whatever else is installed
    ladder = TINY_LADDER if args.tiny else LADDER
    spec = {**spec, "micro": 1, "warmup": 0, "steps": 2, "checkpointing": True,
            "build_bf16": spec["device"] == "cuda" and spec["bf16"],
            "memory_cap_bytes": sum(TINY_CAPACITY.values()) + TINY_OVERHEAD if args.tiny else None}
    build = OpBuild(children, spec, not args.no_prebuild)  # compiles while shardwise's rung runs
    probe = children.run("probe", spec, 120.0)
    if probe["status"] != "ok":
        return {"probe": probe, "deepspeed_op_build": build.close()}
    capacity = capacities(probe, args.tiny)
    rows = plan_ladder(ladder, spec, capacity)
    report: dict[str, Any] = {**environment(probe), "largest_spec": spec, "capacity_bytes": capacity,
                              "fit_share": FIT_SHARE, "planned_ladder": rows}
    fitting = [i for i, row in enumerate(rows) if row["fits"]]
    if fitting:
        guards = (host_floor_guard(int(args.host_floor_gib * 2**30)),)
        runs = Ladder(children, ladder, spec, args.timeout, deadline, guards)
        report.update(search(runs, rows, fitting[-1], build, args))
    else:
        report["shardwise"] = {"predicted": None, "note": "the planner fits no rung"}
    return {**report, "deepspeed_op_build": build.close()}


def search(runs: Ladder, rows: list[dict[str, Any]], best: int, build: OpBuild, args: argparse.Namespace
           ) -> dict[str, Any]:
    """shardwise at the planner's answer (down while it fails), DeepSpeed from shardwise's largest, then the
    rung the planner refused, if time is left."""
    confirmed = runs.walk("shardwise", best, down_only=True)
    sw_largest = _largest_ok(confirmed)
    start = next((i for i, s in enumerate(runs.ladder) if s.name == sw_largest), best)
    build.wait(runs.deadline)
    has_deepspeed = runs.children.has_deepspeed
    deepspeed = runs.walk("deepspeed", start) if has_deepspeed else []
    above = best + 1 if best + 1 < len(runs.ladder) else None
    refused: dict[str, Any] = {"rung": rows[above] if above is not None else None}
    if above is not None and not args.skip_refused and runs.left() > (20 if args.tiny else REFUSED_MIN_LEFT):
        refused["tried"] = runs.attempt("shardwise", above)
    return {"shardwise": {"predicted": runs.ladder[best].name, "largest": sw_largest,
                          "planner_right": bool(confirmed) and confirmed[0]["status"] == "ok", "tried": confirmed,
                          "next_rung": refused},
            "deepspeed": {"tried": deepspeed, "largest": _largest_ok(deepspeed)} if has_deepspeed else
            {"skipped": "DeepSpeed is not available"}}
