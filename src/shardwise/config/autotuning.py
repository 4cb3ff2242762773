"""The `autotuning` section: how `shardwise autotune` (DeepSpeed's `--autotuning tune|run`) searches, and, in
the configs it writes for each experiment, where the run reports its figures. DeepSpeed's keys and defaults;
the keys marked (shardwise) are this tuner's own.

The search space itself is written where the setting lives, as a list or "all" (DeepSpeed's form):
`"zero_optimization": {"stage": [1, 2, 3]}`, `"train_micro_batch_size_per_gpu": [2, 4, 8]`. Such a config is
read by the tuner (autotune/space.py), not by a training run: the parser refuses lists there.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class ModelInfoConfig(_Section):
    """`autotuning.model_info`: `profile` makes a run write what the planner needs of the model (its parameter
    counts and one micro-batch's activations) to `model_info_path` after its first step, then stop. The other
    keys are DeepSpeed's hints, which the profile replaces (accepted, unused)."""

    profile: bool = False
    num_params: int | None = None
    hidden_size: int | None = None
    num_layers: int | None = None


class AutotuningConfig(_Section):
    enabled: bool = False
    results_dir: str | None = Field(None, description="where each experiment's results go (default autotuning_results)")
    exps_dir: str | None = Field(None, description="where each experiment's description goes (default autotuning_exps)")
    overwrite: bool = Field(False, description="rerun experiments whose results exist (false: a rerun resumes)")
    metric: Literal["throughput", "latency", "flops", "FLOPS"] = "throughput"
    start_profile_step: int = Field(3, ge=1, description="the first optimizer step timed")
    end_profile_step: int = Field(5, ge=1, description="the last optimizer step timed; the run stops after it")
    fast: bool = Field(True, description="tune stage, micro-batch and offload only; false also tunes the stage-3 "
                                         "knobs and bucket sizes around the best of those")
    max_train_batch_size: int | None = Field(None, ge=1)
    min_train_batch_size: int = Field(1, ge=1)
    max_train_micro_batch_size_per_gpu: int = Field(1024, ge=1)
    min_train_micro_batch_size_per_gpu: int = Field(1, ge=1)
    num_tuning_micro_batch_sizes: int = Field(3, ge=1, description="micro-batch sizes per stage whose other "
                                                                   "settings are tuned (fast: false)")
    tuner_type: Literal["model_based", "gridsearch", "random"] = Field(
        "model_based", description="model_based: ordered and pruned by the memory planner (shardwise's model); "
        "gridsearch: every candidate; random: candidates in a seeded random order")
    tuner_early_stopping: int = Field(5, ge=1, description="experiments without a better result before a search "
                                                           "dimension stops")
    tuner_num_trials: int = Field(50, ge=1, description="most experiments measured")
    arg_mappings: dict[str, str] | None = Field(
        None, description="config key -> the training script's own flag for it (--per_device_train_batch_size)")
    mp_size: int = Field(1, ge=1, description="model-parallel ranks per data-parallel replica")
    metric_path: str | None = Field(None, description="set by the tuner: the run writes its figures here and stops "
                                                      "after end_profile_step")
    model_info_path: str | None = Field(None, description="set by the tuner: where model_info.profile writes")
    model_info: ModelInfoConfig = ModelInfoConfig()
    memory_per_rank: int | None = Field(
        None, ge=1, description="(shardwise) bytes a candidate's peak must fit in per rank; default what the "
        "profiling run reports of the device (CUDA: its memory; CPU: the host's memory over its ranks)")
    stop_below: float | None = Field(
        None, description="(shardwise, set by the tuner) an experiment whose metric after its first timed step is "
        "worse than this stops there: it cannot beat the best so far")
    experiment_timeout_s: float = Field(1800.0, gt=0, description="(shardwise) an experiment still running after "
                                                                  "this long is stopped and counted as failed")

    @model_validator(mode="after")
    def _profile_window(self) -> AutotuningConfig:
        if self.enabled and self.end_profile_step < self.start_profile_step:
            raise ValueError(f"autotuning.end_profile_step: at least start_profile_step ({self.start_profile_step}); "
                             f"got {self.end_profile_step}. Raise it, or lower start_profile_step.")
        return self

    @property
    def measures(self) -> bool:
        """Whether this run is an experiment of the tuner's (it reports and stops)."""
        return self.enabled and (self.metric_path is not None or self.model_info.profile)
