"""Config sections for seeing a run: monitors (TensorBoard, CSV, wandb), the flops profiler and the
comms logger. Keys and defaults are DeepSpeed's, so a DeepSpeed config's sections validate unchanged.

A base of their own (the same settings as `sections.Section`) keeps this module free of an import
cycle with `sections.py`, which imports these models.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

CollectiveName = Literal["all_reduce", "reduce_scatter", "all_gather", "broadcast"]
# torch.distributed spellings DeepSpeed configs use for the same collectives.
OP_ALIASES = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class FileMonitorConfig(_Section):
    """`tensorboard` / `csv_monitor`: files go to `<output_path>/<job_name>/` (output_path "" means "runs")."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class WandbConfig(_Section):
    """`wandb`: Weights & Biases run; `team` is the wandb entity. Needs the optional `wandb` package."""

    enabled: bool = False
    team: str | None = None
    group: str | None = None
    project: str = "deepspeed"


class FlopsProfilerConfig(_Section):
    """`flops_profiler`: profile one optimizer step (its first micro-batch) and print the module tree."""

    enabled: bool = False
    profile_step: int = Field(1, ge=0, description="optimizer steps completed before the profiled one")
    module_depth: int = Field(-1, ge=-1, description="deepest module level printed; -1 prints all")
    top_modules: int = Field(1, ge=1, description="modules listed per 'top' ranking")
    detailed: bool = True
    output_file: str | None = None
    recompute_fwd_factor: float = Field(
        0.0, ge=0.0,
        description="accepted for DeepSpeed configs; unused: backward FLOPs (recomputation included) are counted",
    )


class CommsLoggerConfig(_Section):
    """`comms_logger`: which collectives the summary table (and verbose lines) cover."""

    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    prof_ops: list[CollectiveName] = Field(default_factory=list)
    debug: bool = False

    @field_validator("prof_ops", mode="before")
    @classmethod
    def _torch_spellings(cls, value: object) -> object:
        if isinstance(value, list):
            return [OP_ALIASES.get(v, v) if isinstance(v, str) else v for v in value]
        return value
