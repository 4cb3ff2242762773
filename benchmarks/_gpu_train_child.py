"""One configuration of benchmarks/gpu_train.py in a process of its own: builds the model, trains warm-up plus
timed steps on one batch of random tokens, and prints one `RESULT {json}` line (step times, losses, peak memory,
what the optimizer was). A shardwise child never sees DeepSpeed and a DeepSpeed child never sees shardwise: the
parent sets each one's PYTHONPATH.

    python benchmarks/_gpu_train_child.py '<spec json>'
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gpu_train_model import ADAMW, CLIP, build_llama, library_config, shape_from_json  # noqa: E402


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _floor(spec: dict[str, Any], model: Any, device: Any) -> tuple[Callable[[Any], float], dict[str, Any]]:
    """A plain PyTorch loop: fp32 parameters, bf16 autocast, torch's fused AdamW, the same clipping."""
    import torch

    betas = tuple(ADAMW["betas"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=ADAMW["lr"], betas=betas, eps=ADAMW["eps"],
                                  weight_decay=ADAMW["weight_decay"], fused=True)

    def step(tokens: Any) -> float:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec["bf16"]):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step, {"library": "torch", "version": torch.__version__, "optimizer": "torch.optim.AdamW(fused=True)"}


def _library(spec: dict[str, Any], model: Any, device: Any) -> tuple[Callable[[Any], float], dict[str, Any]]:
    name = spec["config"]
    if name.startswith("deepspeed"):
        import deepspeed as lib

        if str(lib.__version__).endswith("+shardwise"):
            raise RuntimeError(f"the DeepSpeed child imported shardwise's compat package ({lib.__file__}), "
                               "not DeepSpeed: its site must come first on PYTHONPATH")
    else:
        import shardwise as lib
    config = library_config(name, spec["micro"], spec["bf16"], spec["deepspeed_optimizer"])
    started = time.perf_counter()
    engine, *_ = lib.initialize(model=model, model_parameters=model.parameters(), config=config)
    init_seconds = time.perf_counter() - started  # DeepSpeed builds its CPU Adam op here, on first use

    def step(tokens: Any) -> float:
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        return loss.item()

    inner = getattr(engine, "basic_optimizer", None) or engine.optimizer
    facts = {"library": name.split("-")[0], "version": str(lib.__version__), "config_json": config,
             "optimizer": f"{type(inner).__module__}.{type(inner).__name__}", "init_seconds": round(init_seconds, 2)}
    return step, facts


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    shape = shape_from_json(spec["shape"])
    dtype = torch.bfloat16 if spec.get("build_bf16") else torch.float32
    started = time.perf_counter()
    model = build_llama(shape, spec["seq"], device, dtype)
    if spec["checkpointing"]:
        model.gradient_checkpointing_enable()
    build_seconds = time.perf_counter() - started
    step, facts = (_floor if spec["config"] == "floor" else _library)(spec, model, device)
    tokens = torch.randint(0, shape.vocab, (spec["micro"], spec["seq"]), device=device,
                           generator=torch.Generator(device=device).manual_seed(1))
    times, losses = [], []
    for _ in range(spec["warmup"] + spec["steps"]):
        _sync(device)
        started = time.perf_counter()
        losses.append(step(tokens))
        _sync(device)
        times.append(time.perf_counter() - started)
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {**facts, "config": spec["config"], "build_seconds": round(build_seconds, 2), "losses": losses,
            "warmup_seconds": times[: spec["warmup"]], "step_seconds": times[spec["warmup"]:],
            "peak_device_bytes": peak, "peak_host_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main() -> None:
    spec = json.loads(sys.argv[1])
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(spec["port"]))
    print("RESULT " + json.dumps(run(spec)), flush=True)


if __name__ == "__main__":
    main()
