"""`init_inference`: config → tensor-parallel group → split the model → fill it from the checkpoint → merge LoRA →
cast → quantize → the engine.

The split reuses training's tensor-parallel plans (tensor_parallel/plans.py) and styles, so every model AutoTP
trains is served the same way. A model built on the meta device (`empty_weights()`) is split while it holds no
memory, and each rank then reads only its own pieces from the checkpoint (inference/weights.py): no rank ever
holds the whole model. The world may hold several replicas: ranks [k*tp, (k+1)*tp) form replica k.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist

from .. import accelerator
from ..config import ConfigError
from ..config.inference import InferenceConfig, parse_inference_config
from ..distributed import Collectives, Topology, init_distributed
from ..tensor_parallel import TensorLink, TensorParallelModel, parallelize, resolve_plan
from ..tensor_parallel.plans import Rule
from ..tensor_parallel.styles import COLWISE, ROWWISE
from .empty_weights import meta_names
from .engine import InferenceEngine
from .quantize import quantize_int8
from .sources import open_source
from .weights import check_ranks_hold_same_weights, load_weights

logger = logging.getLogger(__name__)


def init_inference(model: torch.nn.Module, config: str | Path | Mapping[str, Any] | None = None,
                   **kwargs: Any) -> InferenceEngine:
    """DeepSpeed's `init_inference(model, config=None, **kwargs)`: keyword arguments are config keys."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"init_inference: model must be an nn.Module; got {type(model).__name__}.")
    cfg = parse_inference_config(config, kwargs)
    device = accelerator.device_for(int(os.environ.get("LOCAL_RANK", 0)))
    link = _tensor_link(cfg, device)
    _attention_kernels(model, cfg)
    on_meta = bool(meta_names(model)[0])
    if on_meta and cfg.checkpoint is None:
        raise ConfigError(["init_inference: the model's parameters are on the meta device (built under "
                           "empty_weights() or torch.device('meta')) and no checkpoint= was given to fill them; "
                           "pass checkpoint= (a shardwise checkpoint, a safetensors folder or a descriptor)."])
    if not on_meta and link is not None and cfg.checkpoint is None:  # a checkpoint replaces every weight
        check_ranks_hold_same_weights(model, link, device)
    split = _split(model, cfg, link) if link is not None else None
    compute_dtype = _compute_dtype(cfg, model, device)
    if cfg.checkpoint is not None:
        load_weights(model, open_source(cfg.checkpoint, cfg.base_dir), split, compute_dtype, device)
    # by id: merging LoRA renames the base weights, and the cast below keeps each parameter object
    shards = {id(p): split.shards[n] for n, p in model.named_parameters() if n in split.shards} if split else {}
    model = _merge_lora(model)
    model.to(device=device, dtype=compute_dtype)
    if cfg.int8_weights:
        quantize_int8(model, compute_dtype, shards=shards, link=link)
    _note_kernel_keys(cfg)
    return InferenceEngine(model.eval(), cfg, link, device)


def _tensor_link(cfg: InferenceConfig, device: torch.device) -> TensorLink | None:
    tp = cfg.tp_size
    if tp == 1 and not dist.is_initialized():
        return None
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ and "OMPI_COMM_WORLD_SIZE" not in os.environ:
            raise ConfigError([f"init_inference: tensor_parallel.tp_size is {tp}, which needs {tp} processes; start "
                               f"them with `shardwise --num_gpus {tp} script.py` (or torchrun)."])
        init_distributed()
    world = dist.get_world_size()
    if world % tp:
        raise ConfigError([f"init_inference: tensor_parallel.tp_size ({tp}) must divide the number of processes "
                           f"({world}); each group of tp_size ranks serves one replica."])
    topology = Topology(device.type, tensor=tp)
    return TensorLink(Collectives(), topology.tensor)


def _split(model: torch.nn.Module, cfg: InferenceConfig, link: TensorLink) -> TensorParallelModel | None:
    if link.size == 1:
        return None
    rules = _injection_rules(model, cfg.injection_policy) if cfg.injection_policy else resolve_plan(model)
    return parallelize(model, rules, link)


def _injection_rules(model: torch.nn.Module, policy: dict) -> list[Rule]:
    """DeepSpeed's `injection_policy={LayerClass: ("names of", "row-parallel linears")}`: in each layer of those
    classes, the named linears are row-parallel and every other linear column-parallel."""
    rules = []
    for name, module in model.named_modules():
        rows = next((v for k, v in policy.items() if isinstance(module, k) or k == type(module).__name__), None)
        if rows is None:
            continue
        rows = (rows,) if isinstance(rows, str) else tuple(rows)
        for child, sub in module.named_modules():
            if child and isinstance(sub, torch.nn.Linear):
                style = ROWWISE if any(child == r or child.endswith(f".{r}") or r.endswith(f".{child}")
                                       for r in rows) else COLWISE
                rules.append(Rule(re.escape(f"{name}.{child}"), style))
    if not rules:
        raise ConfigError([f"init_inference: injection_policy names {[getattr(k, '__name__', k) for k in policy]}, "
                           "but the model has no module of those classes."])
    return rules


def _compute_dtype(cfg: InferenceConfig, model: torch.nn.Module, device: torch.device) -> torch.dtype:
    if cfg.dtype is not None and cfg.dtype is not torch.int8:
        return cfg.dtype
    if cfg.dtype is torch.int8 and device.type == "cuda":
        return torch.float16  # DeepSpeed's int8 kernels compute in fp16
    floats = [p.dtype for p in model.parameters() if p.is_floating_point()]
    return floats[0] if floats else torch.float32


def _merge_lora(model: torch.nn.Module) -> torch.nn.Module:
    """A PEFT model's LoRA deltas folded into the (split) base weights: one matmul per layer instead of three.
    Each rank folds its own piece (B's rows times A, or B times A's columns), which is its piece of B·A."""
    if not hasattr(model, "merge_and_unload") or not hasattr(model, "peft_config"):
        return model
    with torch.no_grad():
        return model.merge_and_unload()


def _attention_kernels(model: torch.nn.Module, cfg: InferenceConfig) -> None:
    """DeepSpeed's kernel injection swaps in fused attention; shardwise's counterpart is torch's SDPA (flash or
    memory-efficient kernels where the device has them), selected on the Hugging Face model."""
    if cfg.replace_with_kernel_inject and hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("sdpa")


def _note_kernel_keys(cfg: InferenceConfig) -> None:
    asked = [k for k in ("replace_with_kernel_inject", "use_triton") if getattr(cfg, k)]
    if asked:
        logger.info("init_inference: %s asked for; shardwise runs the model's own modules with SDPA attention and "
                    "a static key/value cache", ", ".join(asked))
