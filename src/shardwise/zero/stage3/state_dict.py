"""A stage-3 model's state dict: what `module.state_dict()` returns on one rank, and the consolidated one.

[Note: state_dict() at stage 3] `module.state_dict()` never communicates, so a rank that calls it alone
cannot hang (real scripts do: DeepSpeed-Chat's `save_hf_format` runs on rank 0 only, before every rank saves
through `GatheredParameters`; `if rank == 0: model.save_pretrained(out)`). As in DeepSpeed it returns what
this rank holds: the whole value of each parameter gathered at the time (persistent ones; all of them inside a
`GatheredParameters` block entered on every rank), copied so that it outlives the gather, and DeepSpeed's
empty placeholder for each partitioned one. Placeholders are never returned silently: a warning names them
and says how to get whole weights. Whole weights come from `consolidated_state_dict` (a collective: every
rank calls it, rank 0 receives the weights; `engine._zero3_consolidated_16bit_state_dict()`), which
`engine.save_16bit_model` writes.

A `save_pretrained` (transformers', PEFT's: any method of that name) that asks for its own model's state
dict writes what it gets: placeholders there would make a weights file of empty tensors, which
`from_pretrained` refuses later. There a placeholder raises instead, before any weight is written, and the
error says how to gather first. It cannot gather itself: the call is typically on rank 0 alone
(`if rank == 0: model.save_pretrained(out)`), where a gather would wait forever for the other ranks.
Everywhere else it stays a warning: transformers' own ZeRO-3 `from_pretrained` reads `state_dict()` of a
partitioned model for its keys, PEFT reads the keys of its `modules_to_save` parts inside a `save_pretrained`
given a consolidated state dict, and DeepSpeed-Chat's `save_hf_format` writes the local state dict on rank 0
before overwriting it with the gathered weights.
"""

from __future__ import annotations

import logging
import sys
from collections import OrderedDict
from typing import Any

import torch

from .registry import UNIT_OF
from .unit import ParamUnit, UnitState, held

logger = logging.getLogger(__name__)

_HOW = ("for whole weights call engine._zero3_consolidated_16bit_state_dict() on every rank (rank 0 receives "
        "them), engine.save_16bit_model(dir), or state_dict() inside shardwise.zero.GatheredParameters("
        "list(model.parameters())) entered on every rank")


class LocalStateDict:
    """State-dict hooks on every module: each copies its own gathered parameters and notes its partitioned
    ones; the outermost module of a `state_dict()` call warns about the placeholders."""

    def __init__(self, root: torch.nn.Module):
        self._top: torch.nn.Module | None = None
        self._placeholders: list[str] = []
        self._handles = []
        for module in root.modules():
            # Plain functions: torch marks public state-dict hooks with an attribute, which a bound method cannot take.
            self._handles.append(module.register_state_dict_pre_hook(lambda m, *a: self._before(m)))
            self._handles.append(module.register_state_dict_post_hook(lambda m, s, p, _: self._after(m, s, p)))

    def _before(self, module: torch.nn.Module) -> None:
        if self._top is None or self._top is module:  # `is module`: an earlier call on it raised midway
            self._top, self._placeholders = module, []

    def _after(self, module: torch.nn.Module, state: dict[str, Any], prefix: str) -> None:
        for name, param in module._parameters.items():
            unit = UNIT_OF.get(param) if param is not None else None
            value = state.get(prefix + name)
            if unit is None or value is None or isinstance(value, torch.nn.Parameter):  # keep_vars: the parameter
                continue
            if unit.state is UnitState.FULL:
                state[prefix + name] = value.clone()  # the gathered storage is freed (resized to 0) at release
            else:
                self._placeholders.append(prefix + name)
        if module is self._top:
            self._top = None
            if self._placeholders:
                shown = ", ".join(self._placeholders[:3]) + (" ..." if len(self._placeholders) > 3 else "")
                if _saved_by_save_pretrained(module):
                    raise RuntimeError(
                        f"save_pretrained: {len(self._placeholders)} parameters of this ZeRO-3 model are partitioned "
                        f"({shown}): this rank holds only a slice of each, so the state dict would hold empty "
                        "placeholders and the file would have no weights. No weights were written. Gather on every "
                        "rank first: `with shardwise.zero.GatheredParameters(list(model.parameters())): if rank == 0: "
                        "model.save_pretrained(out)` (deepspeed.zero.GatheredParameters under the deepspeed "
                        "package), or pass state_dict=engine._zero3_consolidated_16bit_state_dict() (called on every "
                        "rank; rank 0 receives the weights, the others None); or call engine.save_16bit_model(out) on "
                        "every rank (with stage3_gather_16bit_weights_on_model_save), or engine.save_checkpoint(dir) "
                        "and then `shardwise checkpoint to-fp32 dir out`.")
                logger.warning(f"ZeRO-3 state_dict(): {len(self._placeholders)} partitioned parameters ({shown}) "
                               "are empty placeholders: this rank holds only a slice of them and state_dict() does not "
                               f"communicate at stage 3 (so calling it on one rank cannot hang); {_HOW}.")

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _saved_by_save_pretrained(module: torch.nn.Module) -> bool:
    """Whether a `save_pretrained` of `module` itself asked for this state dict (not one of a part of it,
    which PEFT asks for its keys only)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "save_pretrained" and frame.f_locals.get("self") is module:
            return True
        frame = frame.f_back
    return False


def consolidated_state_dict(root: torch.nn.Module, rank: int, exclude_frozen: bool = False) -> dict[str, torch.Tensor] | None:
    """The whole state dict, in the parameters' (training) dtype, on CPU, on rank 0; None on the other ranks.

    A collective: every rank calls it. One module's parameters are gathered at a time. The keys are those of
    `state_dict()` (a tied parameter under each of its names, as one tensor), as DeepSpeed's
    `_zero3_consolidated_16bit_state_dict` returns them; `exclude_frozen` leaves out parameters that do not
    require gradients.
    """
    out: dict[str, torch.Tensor] | None = OrderedDict() if rank == 0 else None
    first_name: dict[int, str] = {}

    def visit(module: torch.nn.Module, prefix: str) -> None:
        params = [(n, p) for n, p in module._parameters.items() if p is not None]
        units: list[ParamUnit] = []
        for _, p in params:
            unit = UNIT_OF.get(p)
            if unit is not None and all(unit is not u for u in units):
                units.append(unit)
        with held(units):
            if out is not None:
                for name, p in params:
                    if exclude_frozen and not p.requires_grad:
                        continue
                    if id(p) not in first_name:
                        first_name[id(p)] = prefix + name
                        out[prefix + name] = p.detach().to("cpu", copy=True)
                    else:
                        out[prefix + name] = out[first_name[id(p)]]
                for name, buf in module._buffers.items():
                    if buf is not None and name not in module._non_persistent_buffers_set:
                        out[prefix + name] = buf.detach().to("cpu", copy=True)
        for name, child in module._modules.items():
            if child is not None:
                visit(child, f"{prefix}{name}.")

    visit(root, "")
    return out
