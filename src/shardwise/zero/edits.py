"""Weights edited inside `GatheredParameters(params, modifier_rank=r)`: kept on every rank and in the masters.

[Note: edits reach the masters] With fp16/bf16 (or an offloaded optimizer) the optimizer steps fp32 master
copies and writes them over the module's parameters after each step, so an edit made to a parameter alone is
undone by the next step. On leaving a block with `modifier_rank`, the modifier's parameters are broadcast
(at stages 0-2 too: every rank holds whole parameters there, and only the modifier may have changed them),
then each master takes the edited elements: those where the parameter no longer equals the master rounded
to the parameter's dtype (as it does after every step and every load). The other elements keep their fp32
values; copying the whole parameter would round every master it touches to 16 bits.

At stages 0-2 parameters are not partitioned, so `GatheredParameters` finds their strategy through
`REPLICATED_OWNER` (stage3/registry.py), filled by `register_replicated` when the strategy is built.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable

import torch

from .stage3.registry import REPLICATED_OWNER


def register_replicated(params: Iterable[torch.nn.Parameter], strategy: Any) -> None:
    """`strategy` (held weakly: the engine's lifetime is the user's) keeps `params`' edits (`keep_edits`)."""
    owner = weakref.ref(strategy)
    for p in params:
        REPLICATED_OWNER[p] = owner


@torch.no_grad()
def take_edits(master: torch.Tensor, value: torch.Tensor) -> None:
    """Copy into `master` the elements of `value` (as many, in any dtype, on any device) that differ from
    `master` rounded to `value`'s dtype."""
    value = value.detach().reshape(-1).to(master.device)
    flat = master.data.view(-1)
    edited = flat.to(value.dtype) != value
    if edited.any():
        flat[edited] = value[edited].to(flat.dtype)
