"""`init_inference`'s config: DeepSpeed's keys (`tensor_parallel.tp_size`, `dtype`, `checkpoint`,
`max_out_tokens`, `quant`, ...), given as a dict, a JSON path, keyword arguments, or both (keywords win).

Keys that select DeepSpeed's CUDA kernels (`replace_with_kernel_inject`, `use_triton`, `triangular_masking`) are
accepted and change nothing: shardwise runs the model's own modules with SDPA attention. Keys for features
shardwise has no inference path for (mixture of experts, ZeRO-Inference, activation or key/value quantization,
writing a resharded checkpoint) are refused by name rather than ignored.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Literal, Mapping

import torch
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .base import Section
from .errors import ConfigError
from .parse import load_raw

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "float": torch.float32, "fp16": torch.float16,
          "float16": torch.float16, "half": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "int8": torch.int8}


class InferenceTensorParallelConfig(Section):
    """`tensor_parallel` (alias `tp`): how many ranks split each layer."""

    enabled: bool = True
    tp_size: int = Field(1, ge=1)
    tp_grain_size: int = Field(64, ge=1)
    mpu: Any = None
    tp_group: Any = None

    @model_validator(mode="after")
    def _no_groups(self) -> InferenceTensorParallelConfig:
        if self.mpu is not None or self.tp_group is not None:
            raise ValueError("tensor_parallel.mpu / tp_group: shardwise builds the tensor-parallel group itself from "
                             "the world (tp_size ranks per replica); drop them and set tp_size.")
        return self


class WeightQuantConfig(Section):
    enabled: bool = True
    num_bits: int = 8
    q_type: Literal["symmetric", "asymmetric"] = "symmetric"
    q_groups: int = Field(1, ge=1)
    quantized_initialization: dict = Field(default_factory=dict)
    post_init_quant: dict = Field(default_factory=dict)

    @model_validator(mode="after")
    def _int8_only(self) -> WeightQuantConfig:
        if self.enabled and (self.num_bits != 8 or self.q_type != "symmetric" or self.q_groups != 1):
            raise ValueError(f"quant.weight: shardwise quantizes weights to symmetric int8 with one scale per output "
                             f"channel; got num_bits={self.num_bits}, q_type={self.q_type!r}, q_groups={self.q_groups}. "
                             "Use num_bits 8, q_type \"symmetric\", q_groups 1.")
        return self


class _Off(Section):
    """A quant sub-section shardwise does not implement: accepted only switched off."""

    enabled: bool = False
    num_bits: int = 8
    q_type: str = "symmetric"
    q_groups: int = 1


class QuantConfig(Section):
    """`quant`: int8 weight-only quantization (weights int8 with per-channel scales, activations in `dtype`)."""

    enabled: bool = False
    weight: WeightQuantConfig = Field(default_factory=WeightQuantConfig)
    activation: _Off = Field(default_factory=_Off)
    qkv: _Off = Field(default_factory=_Off)

    @model_validator(mode="after")
    def _weights_only(self) -> QuantConfig:
        for name in ("activation", "qkv"):
            if self.enabled and getattr(self, name).enabled:
                raise ValueError(f"quant.{name}.enabled: shardwise quantizes weights only; set it to false.")
        return self


class InferenceConfig(Section):
    """What `shardwise.init_inference` reads."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, arbitrary_types_allowed=True)
    tensor_parallel: InferenceTensorParallelConfig = Field(default_factory=InferenceTensorParallelConfig,
                                                           validation_alias=AliasChoices("tensor_parallel", "tp"))
    mp_size: int = Field(1, ge=1)
    """DeepSpeed's older spelling of tensor_parallel.tp_size."""
    dtype: torch.dtype | None = None
    """None keeps the model's own dtype (DeepSpeed casts to fp16 by default, which on a CPU is slow and lossy)."""
    checkpoint: Any = None
    """A path (a shardwise checkpoint, a safetensors folder or file, a descriptor JSON), DeepSpeed's descriptor dict,
    or a weight source built already (`load_pretrained` passes a folder chained with an adapter)."""
    base_dir: str = ""
    max_out_tokens: int = Field(1024, gt=0, validation_alias=AliasChoices("max_out_tokens", "max_tokens"))
    min_out_tokens: int = Field(1, ge=0, validation_alias=AliasChoices("min_out_tokens", "min_tokens"))
    quant: QuantConfig = Field(default_factory=QuantConfig)
    enable_cuda_graph: bool = False
    replace_with_kernel_inject: bool = Field(False, validation_alias=AliasChoices("replace_with_kernel_inject",
                                                                                  "kernel_inject"))
    use_triton: bool = False
    triton_autotune: bool = False
    triangular_masking: bool = Field(True, validation_alias=AliasChoices("triangular_masking", "tm"))
    return_tuple: bool = True
    training_mp_size: int = Field(1, ge=1)
    replace_method: str = "auto"
    injection_policy: dict | None = Field(None, validation_alias=AliasChoices("injection_policy", "injection_dict"))
    injection_policy_tuple: tuple | None = None
    keep_module_on_host: bool = False
    set_empty_params: bool = False
    transposed_mode: bool = False
    config: dict | None = Field(None, validation_alias=AliasChoices("config", "args"))
    moe: bool | dict = False
    zero: dict = Field(default_factory=dict)
    save_mp_checkpoint_path: str | None = None
    checkpoint_config: dict = Field(default_factory=dict, validation_alias=AliasChoices("checkpoint_config", "ckpt_config"))

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, value: Any) -> Any:
        if value is None or isinstance(value, torch.dtype):
            return value
        if isinstance(value, str) and value.lower().removeprefix("torch.") in DTYPES:
            return DTYPES[value.lower().removeprefix("torch.")]
        raise ValueError(f"dtype: one of torch.float32, torch.bfloat16, torch.float16 (or \"fp32\", \"bf16\", "
                         f"\"fp16\"); got {value!r}.")

    @field_validator("checkpoint", mode="before")
    @classmethod
    def _checkpoint(cls, value: Any) -> Any:
        if value is None or isinstance(value, (str, dict)):
            return value
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        if all(callable(getattr(value, method, None)) for method in ("find", "shape", "read")):
            return value  # a WeightSource (inference/sources.py)
        raise ValueError(f"checkpoint: a path (a shardwise checkpoint, a safetensors folder, a descriptor JSON), a "
                         f"descriptor dict or a weight source (an object with find, shape and read); got "
                         f"{type(value).__name__}.")

    @model_validator(mode="after")
    def _check(self) -> InferenceConfig:
        tp, legacy = self.tensor_parallel.tp_size, self.mp_size
        if tp > 1 and legacy > 1 and tp != legacy:
            raise ValueError(f"mp_size ({legacy}) and tensor_parallel.tp_size ({tp}) differ; give tp_size only.")
        if self.min_out_tokens > self.max_out_tokens:
            raise ValueError(f"min_out_tokens ({self.min_out_tokens}) exceeds max_out_tokens ({self.max_out_tokens}).")
        for key, off, why in _UNSUPPORTED:
            if getattr(self, key) not in off:
                raise ValueError(f"{key}: {why}; got {getattr(self, key)!r}. Remove it.")
        return self

    @property
    def tp_size(self) -> int:
        return max(self.tensor_parallel.tp_size, self.mp_size) if self.tensor_parallel.enabled else 1

    @property
    def int8_weights(self) -> bool:
        """DeepSpeed's `dtype=torch.int8` means int8 weights too; activations then stay in the model's dtype."""
        return self.dtype is torch.int8 or (self.quant.enabled and self.quant.weight.enabled)


_UNSUPPORTED = [
    ("moe", (False, {}), "mixture-of-experts inference is not built in shardwise"),
    ("zero", ({},), "ZeRO-Inference (weights streamed from CPU/NVMe per layer) is not built in shardwise; tensor "
     "parallelism with int8 weights (quant) is how a model too large for one device is served"),
    ("save_mp_checkpoint_path", (None,), "shardwise does not write a resharded copy: it loads any checkpoint at any "
     "tp_size directly"),
    ("checkpoint_config", ({},), "not read by shardwise; pass checkpoint= and base_dir="),
    ("injection_policy_tuple", (None,), "shardwise splits layers by its tensor-parallel plans; give "
     "injection_policy only as {module class: (row-parallel names,)}"),
    ("set_empty_params", (False,), "not needed: a model built on the meta device (shardwise.inference.empty_weights) "
     "is filled from the checkpoint shard by shard"),
    ("keep_module_on_host", (False,), "not built in shardwise"),
    ("training_mp_size", (1,), "shardwise checkpoints record their own split and load at any tp_size; Megatron "
     "checkpoints are not read"),
]


def parse_inference_config(config: str | Path | Mapping[str, Any] | None, kwargs: Mapping[str, Any]) -> InferenceConfig:
    """The typed config from `config` (dict or JSON path) updated by `kwargs`; every problem at once."""
    raw = load_raw(config) if config is not None else {}
    raw.update(kwargs)
    try:
        return InferenceConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError([_explain(err) for err in e.errors()]) from None


def _explain(err: Mapping[str, Any]) -> str:
    loc = err["loc"]
    path = ".".join(str(p) for p in loc) or "config"
    if err["type"] == "extra_forbidden":
        known = sorted(_fields(loc[:-1]))
        close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
        hint = f"Did you mean '{close[0]}'? " if close else ""
        return f"init_inference: {path}: unknown key. {hint}Keys allowed: {', '.join(known)}."
    if err["type"] == "value_error":
        return f"init_inference: {err['ctx']['error']}" if "ctx" in err else f"init_inference: {err['msg']}"
    return f"init_inference: {path}: {err['msg'][0].lower()}{err['msg'][1:]}; got {err.get('input')!r}."


def _fields(loc: tuple) -> set[str]:
    model: type[BaseModel] = InferenceConfig
    for part in loc:
        field = model.model_fields.get(str(part)) or next(
            (f for f in model.model_fields.values() if f.validation_alias and str(part) in getattr(
                f.validation_alias, "choices", ())), None)
        if field is None or not isinstance(field.annotation, type) or not issubclass(field.annotation, BaseModel):
            return set()
        model = field.annotation
    names = set(model.model_fields)
    for field in model.model_fields.values():
        names.update(c for c in getattr(field.validation_alias, "choices", ()) if isinstance(c, str))
    return names
