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
    bf16_master_weights_and_grads: bool = False
    """The optimizer steps the bf16 parameters themselves, from bf16 gradients: no fp32 master copy (ZeRO 1-3)."""
    bf16_optimizer_states: bool = False
    """Optimizer state (Adam's moments) in bf16; needs `bf16_master_weights_and_grads`."""


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


def bf16_master_problem(bf16: BF16Config, stage: int, grad_accum_dtype: str | None, offload_optimizer: str) -> str | None:
    """Why this combination of DeepSpeed's bf16 master-weight keys cannot run, or None.

    Only both keys together are implemented: the optimizer then steps bf16 parameters, and torch's optimizers
    keep their state in the parameters' dtype. bf16 masters with fp32 state need a host optimizer that keeps
    fp32 moments beside bf16 weights (DeepSpeedCPUAdam), which shardwise does not have."""
    master, states = bf16.bf16_master_weights_and_grads, bf16.bf16_optimizer_states
    if not (master or states):
        return None
    key = "bf16.bf16_master_weights_and_grads" if master else "bf16.bf16_optimizer_states"
    if not bf16.enabled:
        return f"{key}: needs bf16.enabled: true; got bf16 off. Enable bf16 or remove {key}."
    if states and not master:
        return ("bf16.bf16_optimizer_states: needs bf16.bf16_master_weights_and_grads: true (DeepSpeed refuses this "
                "too); got false. Set both, or remove bf16_optimizer_states.")
    if stage == 0:
        return (f"{key}: needs ZeRO stage 1, 2 or 3, as in DeepSpeed (which refuses stage 0 too); got stage 0. Set "
                "zero_optimization.stage, or remove the bf16 master-weight keys.")
    if not states:
        return ("bf16.bf16_master_weights_and_grads: a DeepSpeed setting that shardwise does not implement yet without "
                "bf16.bf16_optimizer_states: true (bf16 master weights with fp32 optimizer state; DeepSpeed runs it "
                "only with offload_optimizer and DeepSpeedCPUAdam); got bf16_optimizer_states false. Set "
                "bf16_optimizer_states: true too, or remove bf16_master_weights_and_grads.")
    if offload_optimizer != "none":
        return (f"bf16.bf16_master_weights_and_grads: a DeepSpeed setting that shardwise does not implement yet with "
                f"zero_optimization.offload_optimizer (bf16 masters and state offloaded); got device "
                f"{offload_optimizer!r}. Keep the optimizer on the device, or remove the bf16 master-weight keys.")
    if grad_accum_dtype not in (None, "bf16"):
        return (f"data_types.grad_accum_dtype: must be bf16 with bf16.bf16_master_weights_and_grads (gradients are "
                f"kept in bf16, as the key says); got {grad_accum_dtype!r}. Remove data_types.grad_accum_dtype.")
    return None
