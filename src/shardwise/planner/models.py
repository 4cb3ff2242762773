"""The model `shardwise plan --model` names, built and traced without a process group.

`--model` is a Hugging Face config (a `config.json` or a directory holding one) or `package.module:factory`,
a callable returning an `nn.Module` (keyword arguments from `--model_arg key=value`). A model too large to
build in host memory is built on the meta device, where the trace counts shapes only.
"""

from __future__ import annotations

import importlib
import json
import os
from typing import Any

import torch

from .shape import ActivationProfile, ModelShape

REAL_TRACE_LIMIT = 2 * 2**30
"""Models above this many parameter bytes are traced on the meta device. There SDPA runs its math kernel,
which saves the [S, S] attention weights that CPU and CUDA's fused kernels do not, so the activations read
somewhat high."""


def build(spec: str, kwargs: dict[str, Any], device: str | torch.device = "cpu") -> torch.nn.Module:
    with torch.device(device):
        if os.path.isdir(spec) or spec.endswith(".json"):
            return _hf_model(spec)
        module_name, sep, attr = spec.partition(":")
        if not sep:
            raise ValueError(f"--model: a Hugging Face config.json (or its directory) or 'package.module:factory'; "
                             f"got {spec!r}.")
        factory = getattr(importlib.import_module(module_name), attr)
        return factory(**kwargs)


def _hf_model(spec: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    path = spec if os.path.isdir(spec) else os.path.dirname(spec) or "."
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"--model {spec}: no config.json there; give a Hugging Face config file or its directory.")
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))


def default_seq_len(model: torch.nn.Module) -> int | None:
    config = getattr(model, "config", None) or getattr(model, "cfg", None)
    for key in ("max_position_embeddings", "n_positions", "seq_len"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


def profile(spec: str, kwargs: dict[str, Any], seq_len: int | None) -> tuple[ModelShape, ActivationProfile, str]:
    """The model's shape and one micro-batch (1 sample of `seq_len` tokens) traced; also how it was traced."""
    meta = build(spec, kwargs, "meta")
    shape = ModelShape.of(meta)
    if shape.total * shape.param_bytes <= REAL_TRACE_LIMIT:
        torch.manual_seed(0)
        model, how = build(spec, kwargs), "traced on the CPU"
    else:
        model, how = meta, "traced on the meta device (attention counted as SDPA's math kernel)"
    seq = seq_len or default_seq_len(model)
    if seq is None:
        raise ValueError("--seq_len: required; the model's config names no maximum length.")
    device = next(model.parameters()).device
    tokens = torch.zeros(1, seq, dtype=torch.long, device=device)
    if hasattr(model, "config") and hasattr(model, "generation_config"):  # a transformers model
        call = lambda: model(input_ids=tokens, labels=tokens)  # noqa: E731
    else:
        call = lambda: model(tokens, tokens)  # noqa: E731
    return shape, ActivationProfile.trace(call, model, 1, seq), how


def parse_model_args(pairs: list[str]) -> dict[str, Any]:
    """`key=value` pairs; values are JSON where they parse (numbers, true), strings otherwise."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--model_arg: 'key=value'; got {pair!r}.")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out
