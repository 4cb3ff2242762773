"""The parts of DeepSpeed's engine surface that only answer questions, mixed into `Engine`.

Scripts written for DeepSpeed, Hugging Face's Trainer and accelerate call these (`fp16_enabled()`,
`zero_optimization_stage()`, `tput_timer`, ...); they read the config and the engine's state and change
nothing, so they live apart from the engine's training logic. Attributes neither the engine nor this
surface has are looked up on the wrapped module, as DeepSpeed does (`engine.gradient_checkpointing_enable()`
reaches a Hugging Face model).
"""

from __future__ import annotations

from typing import Any

import torch


_LOWERCASED_BY_DEEPSPEED = ("adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon")
"""The optimizer types DeepSpeed 0.19.8's config stores in lower case (its DEEPSPEED_OPTIMIZERS); the rest keep the
case they were written in, and scripts compare optimizer_name() with its lower-case constants."""


class DeepSpeedSurface:
    config: Any
    module: torch.nn.Module
    topology: Any
    precision: Any
    optimizer: torch.optim.Optimizer
    _last_step: Any

    # --- batch, learning rate, the last step ------------------------------------------------------
    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    client_optimizer: Any = None
    """The optimizer (or optimizer factory) passed to initialize(), as DeepSpeed keeps it; None when the config
    names the optimizer."""

    def optimizer_name(self) -> str | None:
        """DeepSpeed's: the class name of the optimizer passed to initialize() (of a factory: its own type, such as
        'function', as in DeepSpeed), else the config's optimizer.type as DeepSpeed's config keeps it (lower case for
        the names it lower-cases, else as written: "SGD", "OneBitAdam"), None without either."""
        if self.client_optimizer is not None:
            return type(self.client_optimizer).__name__
        if self.config.optimizer is None:
            return None
        section, written = self.config.get("optimizer"), self.config.optimizer.type
        if isinstance(section, dict) and isinstance(section.get("type"), str):
            written = section["type"]
        return written.lower() if written.lower() in _LOWERCASED_BY_DEEPSPEED else written

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        return self._last_step.grad_norm if self._last_step else None

    def was_step_applied(self) -> bool:
        return bool(self._last_step and self._last_step.applied)

    @property
    def loss_scale(self) -> float:
        return self.precision.loss_scaler.scale

    # --- precision and ZeRO --------------------------------------------------------------------
    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def amp_enabled(self) -> bool:
        return False

    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    def zero_optimization(self) -> bool:
        return self.config.zero_optimization.stage > 0

    def zero_offload_optimizer(self) -> bool:
        return self.config.zero_optimization.offload_optimizer.device != "none"

    def zero_offload_param(self) -> bool:
        return self.config.zero_optimization.offload_param.device != "none"

    def zero_cpu_offload(self) -> bool:
        return self.config.zero_optimization.offload_optimizer.device == "cpu"

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """`stage3_gather_16bit_weights_on_model_save`: whether a model save may gather whole weights."""
        return self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def steps_per_print(self) -> int:
        return self.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """(model dtype, gradient-accumulation dtype), as DeepSpeed reports them."""
        return self.precision.param_dtype, self.precision.grad_accum_dtype

    @property
    def communication_data_type(self) -> torch.dtype:
        return self.precision.reduce_dtype

    # --- layout ------------------------------------------------------------------------------
    @property
    def dp_world_size(self) -> int:
        return self.topology.data.size

    @property
    def mp_world_size(self) -> int:
        return self.topology.sizes["tensor"]

    @property
    def data_parallel_group(self) -> Any:
        return self.topology.data.pg

    # --- data efficiency -----------------------------------------------------------------------------
    random_ltd_scheduler: Any = None
    """The random-LTD scheduler (shardwise.data_efficiency.random_ltd) when the config turns it on."""

    def random_ltd_enabled(self) -> bool:
        return self.random_ltd_scheduler is not None

    # --- attributes of the wrapped module ----------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        try:
            return torch.nn.Module.__getattr__(self, name)  # type: ignore[arg-type]
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("__"):
                raise
            try:
                return getattr(module, name)
            except AttributeError:
                raise AttributeError(f"neither the engine nor its module ({type(module).__name__}) has an "
                                     f"attribute {name!r}") from None
