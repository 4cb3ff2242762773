"""Typed, frozen config sections, one model per DeepSpeed config section.

Only `parse.py` reads the raw JSON/dict; everything downstream receives one of these objects and
reads its fields directly. Every model forbids unknown keys so that a typo is an error, never a
silently ignored setting.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from .base import Section
from .data_efficiency import DataEfficiencyConfig, LegacyCurriculumConfig
from .autotuning import AutotuningConfig
from .monitoring import CommsLoggerConfig, FileMonitorConfig, FlopsProfilerConfig, WandbConfig
from .mixed_precision import BF16Config, DataTypesConfig, Dtype, FP16Config, TorchAutocastConfig, bf16_master_problem
from .training import COMPRESSED_OPTIMIZER_NAMES, OptimizerConfig, SchedulerConfig
from .raw_view import RawConfigView
from .sparse_attention import SparseAttentionConfig

__all__ = ["ActivationCheckpointingConfig", "AioConfig", "BF16Config", "CheckpointConfig", "Config", "DataTypesConfig", "FP16Config", "OffloadOptimizerConfig",
           "OffloadParamConfig", "OptimizerConfig", "PipelineConfig", "SchedulerConfig", "Section", "SparseAttentionConfig", "TorchAutocastConfig", "ZeroConfig"]


OffloadDevice = Literal["none", "cpu", "nvme"]


class OffloadOptimizerConfig(Section):
    """`zero_optimization.offload_optimizer`: where fp32 masters and optimizer state live (stages 1-3)."""

    device: OffloadDevice = "none"
    nvme_path: str | None = None
    pin_memory: bool = False
    buffer_count: int = Field(4, ge=0)
    fast_init: bool = False

    @model_validator(mode="after")
    def _check(self) -> OffloadOptimizerConfig:
        _need_nvme_path(self.device, self.nvme_path, "offload_optimizer")
        return self


class OffloadParamConfig(Section):
    """`zero_optimization.offload_param`: where stage 3's parameter slices live between uses."""

    device: OffloadDevice = "none"
    nvme_path: str | None = None
    pin_memory: bool = False
    buffer_count: int = Field(5, ge=0)
    buffer_size: int = Field(100_000_000, ge=0)
    max_in_cpu: int = Field(1_000_000_000, ge=0)

    @model_validator(mode="after")
    def _check(self) -> OffloadParamConfig:
        _need_nvme_path(self.device, self.nvme_path, "offload_param")
        return self


def _need_nvme_path(device: str, path: str | None, section: str) -> None:
    if device == "nvme" and not path:
        raise ValueError(f"zero_optimization.{section}.nvme_path: required when device is \"nvme\"; got none. "
                         "Point it at a directory on a fast local disk.")


class AioConfig(Section):
    """`aio`: the asynchronous I/O used by NVMe offload."""

    block_size: int = Field(1_048_576, ge=4096)
    queue_depth: int = Field(8, ge=1)
    thread_count: int = Field(1, ge=1)
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool = False


class ZeroConfig(Section):
    """`zero_optimization`. Sizes are in elements, as in DeepSpeed."""

    stage: int = Field(0, ge=0, le=3)
    reduce_bucket_size: int = Field(500_000_000, ge=1)
    allgather_bucket_size: int = Field(500_000_000, ge=0)
    overlap_comm: bool = True
    """DeepSpeed's null ("decide for me") means true here: overlapping is never slower."""
    reduce_scatter: bool = True
    contiguous_gradients: bool = True
    allgather_partitions: bool = True
    round_robin_gradients: bool = False
    elastic_checkpoint: bool = False
    stage3_prefetch_bucket_size: int = Field(50_000_000, ge=0)
    stage3_param_persistence_threshold: int = Field(100_000, ge=0)
    stage3_max_live_parameters: int = Field(1_000_000_000, ge=0)
    stage3_max_reuse_distance: int = Field(1_000_000_000, ge=0)
    stage3_gather_16bit_weights_on_model_save: bool = False
    stage3_module_granularity_threshold: int = Field(0, ge=0)
    """Stage 3: modules of at most this many elements per layer are gathered whole, without hooks on their
    descendants (zero/stage3/leaf.py, [Note: leaves by granularity]); 0: off."""
    sub_group_size: int = Field(1_000_000_000, ge=1)
    offload_optimizer: OffloadOptimizerConfig = OffloadOptimizerConfig()
    offload_param: OffloadParamConfig = OffloadParamConfig()
    node_local_frozen_weights: bool = True
    """Stage 3: parameters that do not train are partitioned over the data-parallel ranks of one node only (a
    whole copy per node), so after loading they never cross the network between nodes. Changes nothing on one
    node or without frozen parameters; false partitions them over every rank, as DeepSpeed does."""
    zero_hpz_partition_size: int = Field(1, ge=1)
    """ZeRO++ hpZ (stage 3): after a forward all-gather each rank keeps 1/size of the whole weights, and later
    gathers before the next step come from these blocks of `size` consecutive ranks (one node's)."""
    zero_quantized_weights: bool = False
    """ZeRO++ qwZ (stage 3): weight all-gathers across the data group travel as int8 with a scale per block."""
    zero_quantized_gradients: bool = False
    """ZeRO++ qgZ (stage 3): the gradient reduce-scatter travels as 4-bit values with a scale per block (an
    all-to-all; each rank sums what it owns)."""

    @field_validator("overlap_comm", mode="before")
    @classmethod
    def _null_is_default(cls, value: object) -> object:
        return True if value is None else value

    @model_validator(mode="after")
    def _offload_stages(self) -> ZeroConfig:
        # offload_param below stage 3 is dropped, with a note, by parse.py (DeepSpeed ignores it there).
        if self.offload_optimizer.device != "none" and self.stage == 0:
            raise ValueError("zero_optimization.offload_optimizer: needs ZeRO stage 1, 2 or 3; got stage 0. "
                             "Set zero_optimization.stage.")
        return self


class CheckpointConfig(Section):
    """`checkpoint`: how saves behave."""

    async_save: bool = False
    """Copy the state to host memory and write it from a background thread while training goes on;
    the next save (or load, or the end of the process) waits for it."""
    tag_validation: Literal["Ignore", "Warn", "Fail"] = "Warn"
    """What to do when ranks save under different tags (any case, as DeepSpeed)."""
    use_node_local_storage: bool = False
    """Accepted for DeepSpeed configs: every rank already writes only its own file."""
    format: Literal["shardwise", "deepspeed"] = "shardwise"
    """"deepspeed" saves in DeepSpeed 0.19's ZeRO layout (at this run's data-parallel size and stage 1-3), for a
    run to go back to DeepSpeed; shardwise loads either (`shardwise checkpoint export` converts afterwards)."""

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _any_case(cls, value: object) -> object:
        return value.capitalize() if isinstance(value, str) else value


class ActivationCheckpointingConfig(Section):
    """`activation_checkpointing`: how `shardwise.runtime.activation_checkpointing.checkpoint` (DeepSpeed's
    `deepspeed.checkpointing.checkpoint`) recomputes; models opt in by calling it. What each key does
    there is described in that module."""

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = Field(None, ge=1)
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


class PipelineConfig(Section):
    """`pipeline`: how a `PipelineModule` trains (the module itself says how it is split)."""

    stages: int | Literal["auto"] = "auto"
    """Checked against the PipelineModule's num_stages ("auto": whatever it has)."""
    partition: str = "best"
    seed_layers: bool = False
    activation_checkpoint_interval: int = Field(0, ge=0)
    pipe_partitioned: bool = True
    grad_partitioned: bool = True
    use_reentrant: bool = True
    schedule: Literal["1f1b", "gpipe", "interleaved_1f1b"] = "1f1b"
    """(shardwise) The order stages run micro-batches in: 1F1B (DeepSpeed's), GPipe, or interleaved 1F1B over
    the module's `num_chunks` (> 1) model chunks per stage."""

    @field_validator("stages", mode="before")
    @classmethod
    def _positive(cls, value: object) -> object:
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ValueError(f"pipeline.stages: a positive number of stages or \"auto\" is required; got {value}.")
        return value


class TensorParallelConfig(Section):
    """`tensor_parallel`: AutoTP training, which splits a Hugging Face (or Megatron-style) model's layers over
    `autotp_size` ranks at `initialize` (shardwise.tensor_parallel)."""

    autotp_size: int = Field(0, ge=0)
    """Ranks each layer is split over; 0 and 1 leave the model whole."""
    vocab_parallel_lm_head: bool | None = None
    """Split the token embedding and LM head over the vocabulary (None: where the model has them); false keeps
    them whole on every rank."""
    partition_config: dict[str, Any] | None = None
    """DeepSpeed's custom rules: {"use_default_specs": bool, "layer_specs": [{"patterns", "partition_type",
    "shape"}]}."""
    preset_model: str | None = None
    """A built-in plan by architecture name, for models whose config does not say it."""
    sequence_parallel: bool = False
    """(shardwise) Norms, residuals and dropout between the split layers hold 1/autotp_size of the tokens
    (LLaMA-family plans): the same bytes on the wire, less activation memory."""

    @property
    def size(self) -> int:
        return max(self.autotp_size, 1)


class Config(Section, RawConfigView):
    """The root of a shardwise / DeepSpeed config, with the batch-size triangle solved; `get`/`[]`/`in`
    read the raw dict as given (see `raw_view.py`)."""

    _raw: dict[str, Any] = PrivateAttr(default_factory=dict)

    def __eq__(self, other: object) -> bool:
        """Equal settings, however they were spelled: the raw dicts (see `raw_view.py`) may differ."""
        if not isinstance(other, Config):
            return NotImplemented
        return self.model_dump() == other.model_dump()

    def __hash__(self) -> int:
        return hash(json.dumps(self.model_dump(mode="json"), sort_keys=True))

    train_batch_size: int = Field(ge=1)
    train_micro_batch_size_per_gpu: int = Field(ge=1)
    gradient_accumulation_steps: int = Field(ge=1)
    steps_per_print: int | float = Field(10, ge=1, description="a float infinity (or null) never reports")
    wall_clock_breakdown: bool = False
    gradient_clipping: float = Field(1.0, ge=0.0, description="global-norm clip; DeepSpeed's default is 1.0, 0 disables")
    prescale_gradients: bool = False
    gradient_predivide_factor: float = Field(1.0, gt=0.0)
    communication_data_type: Dtype | None = None
    dataloader_drop_last: bool = False
    sequence_parallel_size: int | None = Field(
        None, ge=1, description="Ulysses sequence parallelism: this many consecutive ranks share each sequence "
        "(null: 1)")
    seed: int | None = None
    collective_timeout_s: float = Field(
        1800.0, gt=0.0, description="a collective not done after this long is an error naming rank, op and group"
    )
    collective_warn_after_s: float = Field(
        60.0, ge=0.0, description="a collective still pending after this long logs once which ranks have not "
        "arrived, then keeps waiting up to collective_timeout_s; 0 turns the warning off"
    )
    nonfinite_grads: Literal["skip", "raise"] = Field(
        "skip", description="(shardwise) fp32/bf16: a step whose gradient norm is nan/inf is skipped with a "
        "warning (skip) or, having been skipped, raises NonFiniteGradientError (raise)")
    fp16: FP16Config = FP16Config()
    bf16: BF16Config = BF16Config()
    torch_autocast: TorchAutocastConfig = TorchAutocastConfig()
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    zero_optimization: ZeroConfig = ZeroConfig()
    tensorboard: FileMonitorConfig = FileMonitorConfig()
    csv_monitor: FileMonitorConfig = FileMonitorConfig()
    wandb: WandbConfig = WandbConfig()
    flops_profiler: FlopsProfilerConfig = FlopsProfilerConfig()
    comms_logger: CommsLoggerConfig = CommsLoggerConfig()
    memory_breakdown: bool = False
    data_types: DataTypesConfig = DataTypesConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    aio: AioConfig = AioConfig()
    activation_checkpointing: ActivationCheckpointingConfig = ActivationCheckpointingConfig()
    pipeline: PipelineConfig = PipelineConfig()
    tensor_parallel: TensorParallelConfig = TensorParallelConfig()
    curriculum_learning: LegacyCurriculumConfig | None = None
    data_efficiency: DataEfficiencyConfig = DataEfficiencyConfig()
    sparse_attention: SparseAttentionConfig | None = None
    autotuning: AutotuningConfig = AutotuningConfig()

    @field_validator("curriculum_learning", mode="before")
    @classmethod
    def _legacy_curriculum_on(cls, value: object) -> object:
        if isinstance(value, dict) and value.get("enabled") is not True:
            return None  # a switched-off section asks for nothing, and need not name a schedule
        return value

    @field_validator("sparse_attention", mode="before")
    @classmethod
    def _sparse_attention_off(cls, value: object) -> object:
        return None if isinstance(value, dict) and value.get("enabled") is False else value

    @field_validator("steps_per_print", mode="before")
    @classmethod
    def _never(cls, value: object) -> object:
        if value is None or (isinstance(value, float) and math.isinf(value)):
            return math.inf  # DeepSpeed's null default and an infinity (either sign) both mean "never"
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, float):
            raise ValueError(f"steps_per_print: a whole number of steps (or an infinity for never) is required; "
                             f"got {value}. Round it.")
        return value

    @field_validator("communication_data_type", mode="before")
    @classmethod
    def _dtype(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value  # DeepSpeed lower-cases it

    @model_validator(mode="after")
    def _one_precision(self) -> Config:
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError(
                "fp16.enabled and bf16.enabled: at most one may be true; got both. "
                "Pick bf16 on hardware that has it (no loss scaling needed), else fp16."
            )
        training = "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"
        for key in ("param_dtype", "buffer_dtype"):
            given = getattr(self.data_types, key)
            if given is not None and given != training:
                raise ValueError(
                    f"data_types.{key}: must be the training dtype ({training}, from fp16/bf16.enabled); got "
                    f"{given!r}. Set the matching fp16/bf16 'enabled' flag or remove data_types.{key}.")
        return self

    @model_validator(mode="after")
    def _bf16_masters(self) -> Config:
        problem = bf16_master_problem(self.bf16, self.zero_optimization.stage, self.data_types.grad_accum_dtype,
                                      self.zero_optimization.offload_optimizer.device)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _compressed_optimizer_at_stage0(self) -> Config:
        optimizer = self.optimizer.type if self.optimizer is not None else None
        if optimizer in COMPRESSED_OPTIMIZER_NAMES and self.zero_optimization.stage != 0:
            raise ValueError(
                f"zero_optimization.stage: {optimizer} needs stage 0; got stage {self.zero_optimization.stage}. It "
                "averages a whole replicated momentum in 1 bit, which ZeRO's partitions would have to gather first "
                "(DeepSpeed refuses the pair too). Set stage 0, or use Adam/Lamb with ZeRO.")
        return self

    @model_validator(mode="after")
    def _nonfinite_without_loss_scaling(self) -> Config:
        if self.fp16.enabled and self.nonfinite_grads == "raise":
            raise ValueError(
                'nonfinite_grads: "raise" applies to fp32 and bf16 runs; got "raise" with fp16.enabled. fp16\'s loss '
                "scaler skips overflowing steps and lowers the scale, which is how fp16 training proceeds; remove "
                "nonfinite_grads (or use bf16).")
        return self
