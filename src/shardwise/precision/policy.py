"""Precision policy: the dtypes of parameters, of gradient reduction and of master weights.

Orthogonal to sharding: a strategy asks the policy what to allocate and communicate in, and calls
the loss scaler; it never reads the fp16/bf16 config itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import Config
from .loss_scaler import LossScaler, make_loss_scaler

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class PrecisionPolicy:
    param_dtype: torch.dtype
    """What the model computes in (its parameters' dtype on the device)."""
    reduce_dtype: torch.dtype
    """What gradients travel in between ranks."""
    master_dtype: torch.dtype
    """What the optimizer updates and gradients accumulate in: fp32 always, so that small updates and
    sums over micro-batches are not lost to rounding."""
    grad_accum_dtype: torch.dtype
    """What gradients accumulate in across micro-steps and are stepped from: fp32 by default (sums of
    many micro-batches lose bits in 16-bit); `data_types.grad_accum_dtype` = the 16-bit type halves
    gradient memory, as DeepSpeed's ZeRO memory formulas assume."""
    loss_scaler: LossScaler
    auto_cast: bool = False
    """Cast floating-point inputs to `param_dtype` in the engine's forward (fp16.auto_cast)."""

    @property
    def mixed(self) -> bool:
        return self.param_dtype != self.master_dtype

    @classmethod
    def from_config(cls, cfg: Config) -> PrecisionPolicy:
        param = torch.float16 if cfg.fp16.enabled else torch.bfloat16 if cfg.bf16.enabled else torch.float32
        reduce = _DTYPES[cfg.communication_data_type] if cfg.communication_data_type else param
        return cls(
            param_dtype=param,
            reduce_dtype=reduce,
            master_dtype=torch.float32,
            grad_accum_dtype=_DTYPES[cfg.data_types.grad_accum_dtype or "fp32"],
            loss_scaler=make_loss_scaler(cfg.fp16),
            auto_cast=cfg.fp16.enabled and cfg.fp16.auto_cast,
        )



