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
    """What the optimizer updates: fp32, so that small updates are not lost to rounding, unless
    `bf16.bf16_master_weights_and_grads` asks for bf16 (then the parameters are their own masters, and
    torch's optimizers keep their state in bf16 too: `bf16_optimizer_states`, required with it)."""
    grad_accum_dtype: torch.dtype
    """What gradients accumulate in across micro-steps and are stepped from: fp32 by default (sums of
    many micro-batches lose bits in 16-bit); `data_types.grad_accum_dtype` = the 16-bit type halves
    gradient memory, as DeepSpeed's ZeRO memory formulas assume."""
    loss_scaler: LossScaler
    auto_cast: bool = False
    """Cast floating-point inputs to `param_dtype` in the engine's forward (fp16.auto_cast)."""

    @property
    def mixed(self) -> bool:
        """A separate master copy exists: the parameters compute in another dtype than the optimizer steps."""
        return self.param_dtype != self.master_dtype

    @property
    def casts_module(self) -> bool:
        """Buffers and frozen parameters move to `param_dtype` (16-bit training, with or without masters)."""
        return self.param_dtype != torch.float32

    @classmethod
    def from_config(cls, cfg: Config) -> PrecisionPolicy:
        param = torch.float16 if cfg.fp16.enabled else torch.bfloat16 if cfg.bf16.enabled else torch.float32
        reduce = _DTYPES[cfg.communication_data_type] if cfg.communication_data_type else param
        # The config refuses bf16 masters without bf16 optimizer state, at stage 0 and with offload.
        bf16_masters = cfg.bf16.enabled and cfg.bf16.bf16_master_weights_and_grads
        return cls(
            param_dtype=param,
            reduce_dtype=reduce,
            master_dtype=torch.bfloat16 if bf16_masters else torch.float32,
            grad_accum_dtype=torch.bfloat16 if bf16_masters else _DTYPES[cfg.data_types.grad_accum_dtype or "fp32"],
            loss_scaler=make_loss_scaler(cfg.fp16),
            auto_cast=cfg.fp16.enabled and cfg.fp16.auto_cast,
        )



