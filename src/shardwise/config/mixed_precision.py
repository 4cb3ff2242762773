"""Precision sections: `fp16`, `bf16`, `torch_autocast` and `data_types`, with DeepSpeed's dtype spellings."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from .base import Section


class FP16Config(Section):
    enabled: bool = False
    auto_cast: bool = False
    loss_scale: float = Field(0.0, ge=0.0, description="0 selects dynamic loss scaling")
    initial_scale_power: int = Field(16, ge=0, le=64)
    loss_scale_window: int = Field(1000, ge=1)
    hysteresis: int = Field(2, ge=1)
    consecutive_hysteresis: bool = False
    min_loss_scale: float = Field(1.0, gt=0.0)


class BF16Config(Section):
    enabled: bool = False
    check_grad_overflow: bool = True
    """Skip the optimizer step when the gradient norm is not finite (DeepSpeed's default since 0.16)."""


# DeepSpeed's dtype spellings (its DtypeEnum) -> ours.
DTYPE_NAMES = {name: short for short, names in {
    "fp32": ("fp32", "float32", "float", "torch.float32"),
    "fp16": ("fp16", "float16", "half", "torch.float16"),
    "bf16": ("bf16", "bfloat16", "torch.bfloat16"),
}.items() for name in names}
Dtype = Literal["fp32", "fp16", "bf16"]


def dtype_name(value: object) -> object:
    """"bfloat16", "torch.bfloat16", "BF16" ... -> "bf16"; anything else unchanged (validation reports it)."""
    return DTYPE_NAMES.get(value.lower(), value) if isinstance(value, str) else value


class TorchAutocastConfig(Section):
    """`torch_autocast`: run the engine's forward under torch.autocast (DeepSpeed's semantics)."""

    enabled: bool = False
    dtype: Dtype | None = None
    """None: the device's autocast default (bfloat16 on CPU, float16 on CUDA), resolved at initialize."""
    lower_precision_safe_modules: list[str] | None = None

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, value: object) -> object:
        return dtype_name(value)

    @model_validator(mode="after")
    def _bf16_only(self) -> TorchAutocastConfig:
        if self.enabled and self.dtype == "fp16":
            raise ValueError("torch_autocast.dtype: a DeepSpeed setting that shardwise does not implement yet for "
                             "float16 (it needs a gradient scaler); got 'float16'. Use \"bfloat16\", or fp16.enabled.")
        return self


class DataTypesConfig(Section):
    grad_accum_dtype: Dtype | None = None
    param_dtype: Dtype | None = None
    """Must name the training dtype (fp16/bf16.enabled, else fp32), as DeepSpeed checks."""
    buffer_dtype: Dtype | None = None
    """Must name the training dtype: floating buffers are cast with the model."""

    @field_validator("grad_accum_dtype", "param_dtype", "buffer_dtype", mode="before")
    @classmethod
    def _dtypes(cls, value: object) -> object:
        return dtype_name(value)
