"""benchmarks/gpu_train.py --largest: the largest LLaMA-shaped model that trains with ZeRO-3 and optimizer and
parameters offloaded to host memory on the one GPU, for shardwise and for DeepSpeed.

shardwise's memory planner predicts it: each rung of the ladder is planned (device and host parts) against the
card's memory and the host's available memory, the largest rung that fits both (at 90%, the planner's own margin)
is trained for two steps, and the rung above is recorded as the planner refused it. DeepSpeed has no planner, so
it is tried rung by rung from that prediction: up while it trains, down while it fails. Every rung builds its
model in bf16 on the device (so the host holds only what the engine offloads) with activation checkpointing and a
micro-batch of one: the size of the model, not of the batch, is what is measured.
"""

from __future__ import annotations

import time
from typing import Any

from _gpu_train_model import LADDER, TINY_LADDER, Shape, hf_config, library_config

FIT_SHARE = 0.9
TINY_CAPACITY = {"device": 24 * 2**20, "host": 64 * 2**20}
"""--tiny on the CPU: pretend capacities that cut the tiny ladder in its middle, so that every branch runs."""


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

    with torch.device("meta"):
        return ModelShape.of(LlamaForCausalLM(hf_config(shape, seq)))


def capacities(device: str, tiny: bool) -> dict[str, int]:
    import torch

    from shardwise.accelerator import _meminfo_bytes

    if tiny:
        return dict(TINY_CAPACITY)
    return {"device": torch.cuda.get_device_properties(0).total_memory if device == "cuda" else 0,
            "host": _meminfo_bytes("MemAvailable")}


def plan_ladder(ladder: tuple[Shape, ...], spec: dict[str, Any], capacity: dict[str, int]) -> list[dict[str, Any]]:
    from shardwise.planner.plan import plan

    config = library_config("shardwise-3-offload", spec["micro"], spec["bf16"])
    rows = []
    for shape in ladder:
        memory = plan(model_shape(shape, spec["seq"]), config, 1, planned_activations(shape, spec["micro"], spec["seq"]),
                      spec["seq"])
        fits = (memory.peak_device <= FIT_SHARE * capacity["device"] and memory.peak_host <= FIT_SHARE * capacity["host"])
        rows.append({"shape": shape.to_json(), "planned_device_bytes": memory.peak_device,
                     "planned_host_bytes": memory.peak_host, "fits": fits})
    return rows


def _attempt(children: Any, library: str, shape: Shape, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    result = children.run(f"{library}-3-offload", {**spec, "shape": shape.to_json(), "warmup": 0, "steps": 2},
                          timeout)
    keep = ("status", "reason", "returncode", "stderr_tail", "losses", "step_seconds", "peak_device_bytes",
            "peak_host_bytes", "init_seconds", "optimizer", "process_seconds")
    return {"shape": shape.name, "parameters": shape.parameters, **{k: result[k] for k in keep if k in result}}


def _deepspeed_ladder(children: Any, ladder: tuple[Shape, ...], start: int, spec: dict[str, Any],
                      deadline: float) -> list[dict[str, Any]]:
    """Up from `start` while DeepSpeed trains, or down while it fails, until a rung answers the question."""
    tried: list[dict[str, Any]] = []
    index, direction = start, 0
    while 0 <= index < len(ladder) and time.monotonic() < deadline:
        tried.append(_attempt(children, "deepspeed", ladder[index], spec, deadline - time.monotonic()))
        ok = tried[-1]["status"] == "ok"
        if tried[-1]["status"] == "skipped" or (direction == 1 and not ok) or (direction == -1 and ok):
            break
        direction = direction or (1 if ok else -1)
        index += direction
    return tried


def largest(children: Any, spec: dict[str, Any], tiny: bool, budget: float) -> dict[str, Any]:
    ladder = TINY_LADDER if tiny else LADDER
    spec = {**spec, "micro": 1, "checkpointing": True, "build_bf16": spec["device"] == "cuda"}
    capacity = capacities(spec["device"], tiny)
    rows = plan_ladder(ladder, spec, capacity)
    fitting = [i for i, row in enumerate(rows) if row["fits"]]
    deadline = time.monotonic() + budget
    report: dict[str, Any] = {"largest_spec": spec, "capacity_bytes": capacity, "fit_share": FIT_SHARE,
                              "planned_ladder": rows}
    if not fitting:
        report["shardwise"] = {"predicted": None, "note": "the planner fits no rung of the ladder"}
        return report
    best = fitting[-1]
    confirmed = _attempt(children, "shardwise", ladder[best], spec, deadline - time.monotonic())
    above = rows[best + 1] if best + 1 < len(rows) else None
    report["shardwise"] = {"predicted": ladder[best].name, "confirmed": confirmed,
                           "next_rung_refused_by_planner": above}
    report["deepspeed"] = _deepspeed_ladder(children, ladder, best, spec, deadline)
    ok = [t for t in report["deepspeed"] if t["status"] == "ok"]
    report["deepspeed_largest"] = max(ok, key=lambda t: t["parameters"])["shape"] if ok else None
    return report
