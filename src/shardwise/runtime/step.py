"""One optimizer step, the same for every strategy: overflow check, unscale, clip, step, rescale.

Overflow and clipping both come from one global gradient norm: a non-finite norm means some gradient
is nan or inf, and the same norm gives the clip coefficient. Unscaling and clipping are folded into
one multiply. Reading the norm is the step's one device sync; the non-finite check costs nothing more.

A step with a non-finite norm is skipped at every precision: with fp16 it is an overflow that the loss
scaler expects (it lowers the scale), with fp32/bf16 a nan/inf loss or a divergence. Either way no nan
reaches the weights; the engine reports it (`nonfinite_grads`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch

from ..precision import LossScaler
from ..protocols import ShardingStrategy


class NonFiniteGradientError(FloatingPointError):
    """A step's gradient norm was nan/inf with `"nonfinite_grads": "raise"` (the update was not applied)."""


@dataclass(frozen=True)
class StepResult:
    applied: bool
    grad_norm: float
    """Global norm of the unscaled gradients before clipping; nan/inf on a skipped step."""


def take_step(strategy: ShardingStrategy, scaler: LossScaler, clip: float,
              timed_sync: Callable[[], ContextManager[None]] = contextlib.nullcontext,
              grad_norm: Callable[[], torch.Tensor] | None = None) -> StepResult:
    """`grad_norm` replaces the strategy's norm where the model spans more than its ranks (pipeline stages)."""
    scale = scaler.scale
    norm = float((grad_norm or strategy.grad_norm)()) / scale
    finite = math.isfinite(norm)
    scaler.update(not finite)  # a no-op without fp16's loss scaler
    if not finite:
        strategy.zero_grads()
        return StepResult(False, norm)
    factor = 1.0 / scale
    if clip > 0:
        # torch.nn.utils.clip_grad_norm_'s coefficient, applied only when it shrinks.
        factor *= min(1.0, clip / (norm + 1e-6))
    if factor != 1.0:
        strategy.scale_grads(factor)
    strategy.optimizer_step()
    with timed_sync():
        strategy.sync_params()
    strategy.zero_grads()
    return StepResult(True, norm)
