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

from .ranks import RankLayout, split_as_rank
from .shape import ActivationProfile, ModelShape

REAL_TRACE_LIMIT = 2 * 2**30
"""Models above this many parameter bytes are traced on the meta device. There SDPA runs its math kernel,
which saves the [S, S] attention weights that CPU and CUDA's fused kernels do not, so the activations read
somewhat high."""


FORMS = ("a Hugging Face config.json (or its directory), or 'package.module:factory' naming a callable that returns "
         "an nn.Module (its keyword arguments from --model_arg key=value)")


def build(spec: str, kwargs: dict[str, Any], device: str | torch.device = "cpu") -> torch.nn.Module:
    with torch.device(device):
        if os.path.isdir(spec) or spec.endswith(".json"):
            return _hf_model(spec)
        return _from_factory(spec, kwargs)


def _from_factory(spec: str, kwargs: dict[str, Any]) -> torch.nn.Module:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model: {FORMS}; got {spec!r}.")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"--model: {FORMS}; got {spec!r}, whose module cannot be imported ({e}).") from e
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        what = f"has no {attr!r}" if factory is None else f"has {attr!r}, a {type(factory).__name__}, not a callable"
        raise ValueError(f"--model: {FORMS}; got {spec!r}, but {module_name} {what}.")
    call = f"{module_name}.{attr}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"
    try:
        model = factory(**kwargs)
    except Exception as e:  # a failure inside the factory says nothing of what --model expects; name both
        raise ValueError(f"--model: {call} raised {type(e).__name__}: {e}. --model takes {FORMS}.") from e
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"--model: {call} returned a {type(model).__name__}, not an nn.Module; --model takes "
                         f"{FORMS}.")
    return model


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


def profile(spec: str, kwargs: dict[str, Any], seq_len: int | None,
            ranks: RankLayout | None = None) -> tuple[ModelShape, ActivationProfile, str]:
    """One rank's share of the model (split as `ranks` says, see [Note: one account of a rank]) and one
    micro-batch (1 sample of `seq_len` tokens) traced through it; also how it was traced."""
    if seq_len is not None and seq_len < 1:
        raise ValueError(f"--seq_len: at least 1 token; got {seq_len}.")
    meta = build(spec, kwargs, "meta")
    whole = ModelShape.of(meta)
    if ranks is not None:
        split_as_rank(meta, ranks)
    shape = ModelShape.of(meta)
    if whole.total * whole.param_bytes <= REAL_TRACE_LIMIT:
        torch.manual_seed(0)
        model, how = build(spec, kwargs), "traced on the CPU"
        if ranks is not None:
            split_as_rank(model, ranks)
    else:
        model, how = meta, "traced on the meta device (attention counted as SDPA's math kernel)"
    seq = seq_len if seq_len is not None else default_seq_len(model)
    if seq is None:
        raise ValueError("--seq_len: required; the model's config names no maximum length.")
    sequence = ranks.sequence if ranks is not None else 1
    if seq % sequence:
        raise ValueError(f"--seq_len: {seq} tokens cannot be cut into {sequence} equal slices "
                         f"(sequence_parallel_size); give a multiple of {sequence}.")
    seq //= sequence  # a rank's slice: Ulysses keeps 1/sequence of the tokens everywhere but inside attention
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
