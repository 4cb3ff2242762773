"""`curriculum_learning` (DeepSpeed's legacy section) and `data_efficiency` (curriculum by data difficulty,
random-LTD): their typed, frozen sections. `shardwise.data_efficiency` acts on them.

A schedule maps an optimizer step to a difficulty (a sequence length, a metric value or percentile) or a
kept-token count; its keys are checked here against its `schedule_type`, so a config missing one fails at
`initialize`, not thousands of steps in.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, field_validator, model_validator

from .base import Section

ScheduleType = Literal["fixed_linear", "fixed_root", "fixed_discrete", "custom"]
_NEEDS = {"fixed_linear": ("total_curriculum_step", "difficulty_step"),
          "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
          "fixed_discrete": ("difficulty", "max_step"), "custom": ()}


class ScheduleConfig(Section):
    """`schedule_config`: the keys of every schedule type; which ones are required depends on the type."""

    total_curriculum_step: int | None = Field(None, ge=1)
    difficulty_step: int | None = Field(None, ge=1)
    root_degree: float | None = Field(None, gt=0)
    difficulty: list[int | float] | None = None
    max_step: list[int] | None = None


class CurriculumSchedule(Section):
    """A difficulty that grows from `min_difficulty` to `max_difficulty` over optimizer steps."""

    min_difficulty: int | float
    max_difficulty: int | float
    schedule_type: ScheduleType
    schedule_config: ScheduleConfig = ScheduleConfig()

    @model_validator(mode="after")
    def _schedule_keys(self) -> CurriculumSchedule:
        missing = [k for k in _NEEDS[self.schedule_type] if getattr(self.schedule_config, k) is None]
        if missing:
            raise ValueError(f"schedule_config: schedule_type {self.schedule_type!r} needs {', '.join(missing)}; got "
                             f"{self.schedule_config.model_dump(exclude_none=True)}. Add them (see DeepSpeed's "
                             "curriculum learning docs for their meaning).")
        if self.min_difficulty > self.max_difficulty:
            raise ValueError(f"min_difficulty: must not exceed max_difficulty ({self.max_difficulty}); got "
                             f"{self.min_difficulty}. Swap them.")
        if self.schedule_type == "fixed_discrete":
            levels, ends = self.schedule_config.difficulty or [], self.schedule_config.max_step or []
            if not levels or len(levels) != len(ends) + 1 or ends != sorted(ends):
                raise ValueError(f"schedule_config: fixed_discrete needs one more difficulty than max_step (the last "
                                 f"difficulty holds after the last max_step) and max_step increasing; got difficulty="
                                 f"{levels}, max_step={ends}.")
            outside = [d for d in levels if not self.min_difficulty <= d <= self.max_difficulty]
            if outside:  # the schedule would train at them as given: nothing clamps a discrete level
                raise ValueError(f"schedule_config.difficulty: every level must lie within [min_difficulty, "
                                 f"max_difficulty] = [{self.min_difficulty}, {self.max_difficulty}]; got "
                                 f"{', '.join(map(str, outside))} (in {levels}). Change those levels or the bounds.")
        elif self.schedule_type in ("fixed_linear", "fixed_root"):
            step = self.schedule_config.difficulty_step
            assert step is not None  # _NEEDS
            lowest = math.ceil(self.min_difficulty / step) * step
            if lowest > self.max_difficulty:  # the schedule would sit at max_difficulty from the first step
                raise ValueError(f"schedule_config.difficulty_step: the difficulties are multiples of it, so one must "
                                 f"lie within [min_difficulty, max_difficulty] = [{self.min_difficulty}, "
                                 f"{self.max_difficulty}]; got {step}, whose first multiple from min_difficulty on is {lowest}. "
                                 "Lower difficulty_step or widen the bounds.")
        return self


class LegacyCurriculumConfig(CurriculumSchedule):
    """DeepSpeed's top-level `curriculum_learning` (removed from DeepSpeed 0.19.8, kept for older configs): the
    engine trains on the first `difficulty` positions of every sequence."""

    enabled: bool = False
    curriculum_type: Literal["seqlen"] = "seqlen"

    @model_validator(mode="after")
    def _positions(self) -> LegacyCurriculumConfig:
        if self.min_difficulty < 1:  # the difficulty is a count of positions; 0 reaches the model as an empty batch
            raise ValueError(f"min_difficulty: the seqlen curriculum's difficulty is a sequence length, at least 1; "
                             f"got {self.min_difficulty}. Set it to the shortest length to train on (DeepSpeed's "
                             "examples start at 8).")
        return self


class CurriculumMetricConfig(CurriculumSchedule):
    """One metric of `data_sampling.curriculum_learning.curriculum_metrics`: its index (written by
    `shardwise.data_efficiency.DataAnalyzer`) and its schedule."""

    index_to_sample_path: str | None = None
    index_to_metric_path: str | None = None
    difficulty_type: Literal["value", "percentile"] = "value"
    clustering_type: Literal["schedule_based", "single_cluster"] = "schedule_based"

    @model_validator(mode="after")
    def _percentiles(self) -> CurriculumMetricConfig:
        if self.difficulty_type == "percentile" and (self.min_difficulty < 0 or self.max_difficulty <= 0):
            # a percentile admits the easiest difficulty / max_difficulty share of the samples
            raise ValueError(f"min_difficulty: with difficulty_type \"percentile\" min_difficulty >= 0 and "
                             f"max_difficulty > 0 (the whole, 100 say) are required; got min_difficulty "
                             f"{self.min_difficulty}, max_difficulty {self.max_difficulty}.")
        return self


class DataCurriculumConfig(Section):
    """`data_efficiency.data_sampling.curriculum_learning`."""

    enabled: bool = False
    data_cluster_path: str | None = None
    curriculum_metrics: dict[str, CurriculumMetricConfig] | None = Field(default_factory=dict)
    """Never None once validated (null, DeepSpeed's default, becomes {}); the schema lets editors accept null."""

    @field_validator("curriculum_metrics", mode="before")
    @classmethod
    def _null_is_none(cls, value: object) -> object:
        return {} if value is None else value  # DeepSpeed's default

    @model_validator(mode="after")
    def _has_metric(self) -> DataCurriculumConfig:
        assert self.curriculum_metrics is not None  # the before-validator's {}
        if self.enabled and not self.curriculum_metrics:
            raise ValueError("curriculum_metrics: curriculum learning needs at least one metric; got none. Add a "
                             "metric with its index paths and schedule, or set enabled to false.")
        return self


class DataSamplingConfig(Section):
    enabled: bool = False
    num_epochs: int = Field(1000, ge=1)
    num_workers: int = Field(0, ge=0)
    curriculum_learning: DataCurriculumConfig = DataCurriculumConfig()


class RandomLTDScheduleValues(Section):
    require_steps: int = Field(ge=1)
    seq_per_step: int = Field(ge=1)


class RandomLTDSchedule(Section):
    """Tokens each random-LTD layer keeps: `min_value` growing linearly to `max_value` over `require_steps`."""

    min_value: int = Field(ge=1)
    max_value: int = Field(ge=1)
    schedule_type: Literal["fixed_linear"] = "fixed_linear"
    schedule_config: RandomLTDScheduleValues

    @model_validator(mode="after")
    def _ordered(self) -> RandomLTDSchedule:
        if self.min_value > self.max_value:
            raise ValueError(f"random_ltd_schedule.min_value: must not exceed max_value ({self.max_value}); got "
                             f"{self.min_value}.")
        if self.min_value < self.schedule_config.seq_per_step:
            raise ValueError(f"random_ltd_schedule.min_value: at least schedule_config.seq_per_step "
                             f"({self.schedule_config.seq_per_step}) is required, as the kept count is rounded down "
                             f"to a multiple of it and would start at 0 tokens; got {self.min_value}. Raise "
                             "min_value or lower seq_per_step.")
        return self


class LayerTokenLRSchedule(Section):
    enabled: Literal[False] = False
    total_layer_tokens: int | None = None
    warmup_type: str | None = None
    warmup_layer_tokens: int | None = None


class RandomLTDConfig(Section):
    """`data_efficiency.data_routing.random_ltd`: layers `random_ltd_layer_id` see a random subset of tokens."""

    enabled: bool = False
    total_layer_num: int | None = Field(None, ge=1)
    random_ltd_layer_num: int | None = Field(None, ge=1)
    random_ltd_layer_id: list[int] = Field(default_factory=list)
    model_mask_name: str | None = None
    model_type: Literal["decoder", "encoder"] = "decoder"
    hidden_state_order: Literal["batch_seq_dim", "seq_batch_dim"] = "batch_seq_dim"
    random_ltd_schedule: RandomLTDSchedule | None = None
    layer_token_lr_schedule: LayerTokenLRSchedule = LayerTokenLRSchedule()

    @model_validator(mode="after")
    def _layers(self) -> RandomLTDConfig:
        if not self.enabled:
            return self
        if not self.random_ltd_layer_id or self.random_ltd_schedule is None:
            raise ValueError("random_ltd: random_ltd_layer_id (the layers that drop tokens) and random_ltd_schedule "
                             "are required when enabled; add them.")
        if self.random_ltd_layer_num is not None and self.random_ltd_layer_num != len(self.random_ltd_layer_id):
            raise ValueError(f"random_ltd.random_ltd_layer_num: must equal the length of random_ltd_layer_id "
                             f"({len(self.random_ltd_layer_id)}); got {self.random_ltd_layer_num}.")
        if len(set(self.random_ltd_layer_id)) != len(self.random_ltd_layer_id) or min(self.random_ltd_layer_id) < 0:
            raise ValueError(f"random_ltd.random_ltd_layer_id: distinct layer indices >= 0 are required; got "
                             f"{self.random_ltd_layer_id}.")
        return self


class DataRoutingConfig(Section):
    enabled: bool = False
    random_ltd: RandomLTDConfig = RandomLTDConfig()


class DataEfficiencyConfig(Section):
    """`data_efficiency`: a feature acts only when it and every section above it are enabled (as in DeepSpeed)."""

    enabled: bool = False
    seed: int = 1234
    data_sampling: DataSamplingConfig = DataSamplingConfig()
    data_routing: DataRoutingConfig = DataRoutingConfig()

    @property
    def curriculum(self) -> DataCurriculumConfig | None:
        """The data-sampling curriculum when it is switched on all the way down, else None."""
        sampling = self.data_sampling
        on = self.enabled and sampling.enabled and sampling.curriculum_learning.enabled
        return sampling.curriculum_learning if on else None

    @property
    def random_ltd(self) -> RandomLTDConfig | None:
        routing = self.data_routing
        return routing.random_ltd if self.enabled and routing.enabled and routing.random_ltd.enabled else None
