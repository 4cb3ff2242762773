"""Whole fp32 values of one parameter, whatever the layout: DeepSpeed's `safe_get_full_fp32_param`,
`safe_get_full_optimizer_state`, `safe_set_full_fp32_param`, `safe_set_full_optimizer_state`.

DeepSpeed's API receives a bare parameter, so an engine registers its module's parameters here when it is
built (`register`); the table holds weak references only, like `zero/stage3/registry.py`. Values are
assembled from the strategy's state slots (`StateSlot`: the pieces of a parameter's fp32 master and
optimizer state this rank holds), so one code path serves stages 0-3 with or without offload. Getting
and setting are collectives over the data-parallel group: every rank must call them, as in DeepSpeed.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..protocols import TrainingEngine

_ENGINE_OF: WeakIdKeyDictionary = WeakIdKeyDictionary()  # Parameter -> weakref to the Engine


def register(engine: TrainingEngine) -> None:
    """Let the safe_* functions find `engine` from any of its module's parameters."""
    ref = weakref.ref(engine)
    for p in engine.module.parameters():
        _ENGINE_OF[p] = ref


def _engine(param: torch.nn.Parameter) -> Any:
    ref = _ENGINE_OF.get(param)
    engine = ref() if ref is not None else None
    if engine is None:
        raise ValueError("param: not a parameter of a live shardwise engine's module; call this on "
                         "engine.module's parameters after initialize().")
    return engine


def _name(engine: TrainingEngine, param: torch.nn.Parameter) -> str:
    return next(n for n, p in engine.module.named_parameters() if p is param)


def _pieces(engine: TrainingEngine, param: torch.nn.Parameter, key: str | None) -> list[tuple[Any, torch.Tensor]]:
    """(slot, this rank's piece) for `param`: its master values, or optimizer state `key`."""
    name = _name(engine, param)
    out = []
    for slot in engine.strategy.state_slots():
        if slot.name != name:
            continue
        if key is None:
            out.append((slot, slot.values))
            continue
        if not slot.trainable:
            raise ValueError(f"{name}: frozen parameters have no optimizer state.")
        state = engine.optimizer.state.get(slot.opt_param, {})
        if key not in state:
            raise KeyError(f"{name}: no optimizer state {key!r} (has {sorted(state)}); it exists after the first step.")
        out.append((slot, state[key].view(-1)[slot.opt_offset : slot.opt_offset + slot.end - slot.start]))
    return out


def _get_full(param: torch.nn.Parameter, key: str | None) -> torch.Tensor:
    engine = _engine(param)
    group = engine.topology.data
    with engine.strategy.resident():
        pieces = _pieces(engine, param, key)
        # A rank may hold no piece of a small ZeRO-3 parameter; its whole shape is then `ds_shape`.
        shape = pieces[0][0].shape if pieces else tuple(getattr(param, "ds_shape", param.shape))
        full = torch.zeros(torch.Size(shape).numel(), dtype=torch.float32, device=engine.device)
        for slot, piece in pieces:
            if slot.replica == 0:  # a piece several ranks hold is summed once
                full[slot.start : slot.end] = piece.to(full.device, torch.float32)
    engine.comm.all_reduce(full, group).wait()
    return full.view(shape)


def _set_full(param: torch.nn.Parameter, value: torch.Tensor, key: str | None) -> None:
    engine = _engine(param)
    flat = value.detach().reshape(-1)
    with engine.strategy.resident(), torch.no_grad():
        for slot, piece in _pieces(engine, param, key):
            piece.copy_(flat[slot.start : slot.end])
        if key is None:
            engine.strategy.after_state_load()


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor:
    """The whole fp32 master of `param` on every rank (a collective)."""
    return _get_full(param, None)


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor:
    """The whole optimizer state `optim_state_key` ("exp_avg", "exp_avg_sq", ...) of `param` on every rank."""
    return _get_full(param, optim_state_key)


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set the fp32 master of `param` (and the module's copy) from a whole tensor given on every rank."""
    _set_full(param, value, None)


def safe_set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    _set_full(param, value, optim_state_key)


def unsupported_grad_access(name: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{name}: reading gradients by parameter is not supported by shardwise yet; "
                                  "gradients live in the engine's reduction buckets. Read them in a backward hook "
                                  "on the module instead, or ask for this on the issue tracker.")

    return refuse


safe_get_full_grad = unsupported_grad_access("safe_get_full_grad")
safe_get_local_grad = unsupported_grad_access("safe_get_local_grad")
