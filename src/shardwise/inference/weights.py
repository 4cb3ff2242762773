"""Fill a (split) model's parameters from a weight source, one tensor at a time, each rank reading only its piece.

A parameter on the meta device gets new storage here; one tied to others (an embedding shared with the LM head)
is read once and stays shared. Every parameter must be found: a model half-filled from a checkpoint would generate
plausible-looking nonsense, so a missing name is an error that lists what is missing and what the source holds.
"""

from __future__ import annotations

import logging

import torch

from ..checkpoint.errors import CheckpointError
from ..tensor_parallel import TensorLink, TensorParallelModel
from .sources import WeightSource, candidates

logger = logging.getLogger(__name__)


def load_weights(model: torch.nn.Module, source: WeightSource, split: TensorParallelModel | None,
                 dtype: torch.dtype, device: torch.device) -> None:
    shards = split.shards if split is not None else {}
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    prefixes = _prefixes(model)
    loaded: dict[int, torch.nn.Parameter] = {}
    missing = []
    for name, param in model.named_parameters():
        key = _find(source, names[id(param)], prefixes)
        if key is None:
            missing.append(name)
            continue
        shard = next((shards[n] for n in names[id(param)] if n in shards), None)
        tensor = source.read(key, shard, dtype if param.is_floating_point() else param.dtype)
        if tuple(tensor.shape) != tuple(param.shape):
            raise CheckpointError(f"init_inference: {key!r} in the checkpoint gives shape {tuple(tensor.shape)} for "
                                  f"{name!r}, which has shape {tuple(param.shape)} on this rank; the checkpoint is "
                                  "not this model's (check the model config).")
        loaded[id(param)] = torch.nn.Parameter(tensor.to(device), requires_grad=False)
    if missing:
        raise CheckpointError(f"init_inference: the checkpoint has no weights for {len(missing)} of the model's "
                              f"parameters: {missing[:6]}{' ...' if len(missing) > 6 else ''}. Build the model the "
                              "checkpoint was trained as (a PEFT model for a LoRA checkpoint), or point at the right "
                              "checkpoint.")
    _replace(model, loaded)
    _load_buffers(model, source, prefixes, device)
    logger.info("init_inference: %d weights loaded", len(loaded))


def _prefixes(model: torch.nn.Module) -> tuple[str, ...]:
    base = getattr(model, "base_model_prefix", "") or getattr(getattr(model, "base_model", None), "base_model_prefix", "")
    return (f"{base}.",) if isinstance(base, str) and base else ()


def _find(source: WeightSource, names: list[str], prefixes: tuple[str, ...]) -> str | None:
    for name in names:
        for candidate in candidates(name, prefixes=prefixes):
            key = source.find(candidate)
            if key is not None:
                return key
    return None


def _replace(model: torch.nn.Module, loaded: dict[int, torch.nn.Parameter]) -> None:
    for module in model.modules():
        for attr, param in list(module._parameters.items()):
            if param is not None and id(param) in loaded:
                module._parameters[attr] = loaded[id(param)]


def _load_buffers(model: torch.nn.Module, source: WeightSource, prefixes: tuple[str, ...], device: torch.device) -> None:
    """Persistent buffers the source holds replace the constructed ones; the others (rotary frequencies, masks)
    were computed when the model was built."""
    for name, buffer in list(model.named_buffers()):
        key = _find(source, [name], prefixes)
        if key is not None and tuple(source.shape(key)) == tuple(buffer.shape):
            buffer.data = source.read(key, None, buffer.dtype).to(device)


def check_ranks_hold_same_weights(model: torch.nn.Module, link: TensorLink, device: torch.device) -> None:
    """A model built whole on every rank is split by taking each rank's piece: the ranks' copies must be equal (loaded
    from the same files, or the same seed), or the pieces would come from different models."""
    params = [p for p in model.parameters() if p.is_floating_point()]
    if not params:
        return
    if not link.agrees(torch.stack([p.detach().double().sum() for p in params]).to(device)):
        raise ValueError("init_inference: the tensor-parallel ranks hold different weights (the model was built with "
                         "different random values on each); load it from the same files on every rank, seed every "
                         "rank alike, or pass checkpoint= so every rank reads its piece of the same weights.")
