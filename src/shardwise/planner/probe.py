"""With `memory_breakdown: true` the engine checks the plan against the run: it measures the peak of step 2
(the first step with the optimizer state in place) and logs it beside the plan's prediction."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from ..config import Config
from ..monitor.reporter import StepFigures
from ..profiling.memory import MemoryBreakdown
from ..profiling.units import binary_bytes
from .measure import AllocationMeter
from .plan import MemoryPlan, plan
from .shape import ActivationProfile, ModelShape

CHECKED_STEP = 2

log = logging.getLogger("shardwise")


@dataclass(frozen=True)
class PlanCheck:
    planned: MemoryPlan
    measured: int
    """Peak bytes allocated during step 2: on CUDA the device's; on CPU all of the allocator's, which the
    plan's device and host parts share."""
    on_cpu: bool

    @property
    def predicted(self) -> int:
        return self.planned.peak_total if self.on_cpu else self.planned.peak_device

    @property
    def ratio(self) -> float:
        return self.predicted / self.measured if self.measured else float("nan")


class PlanProbe:
    def __init__(self, config: Config, module: torch.nn.Module, device: torch.device, dp_size: int,
                 breakdown: Callable[[], MemoryBreakdown], activations_peak: Callable[[], int | None], rank: int):
        self.config, self.module, self.device, self.dp_size, self.rank = config, module, device, dp_size, rank
        self._activations_peak = activations_peak
        held = breakdown()
        baseline = held.model_states + held.buffers.total
        self.meter = AllocationMeter(device, baseline).start()
        self._mark: int | None = None
        self.check: PlanCheck | None = None

    def on_step(self, figures: StepFigures) -> None:
        step = figures.step
        if step == CHECKED_STEP - 1:
            self._mark = self.meter.mark()
        elif step == CHECKED_STEP and self._mark is not None:
            self.meter.stop()
            self.check = PlanCheck(self._plan(), self.meter.peak_since(self._mark), self.device.type == "cpu")
            self._log(self.check)

    def close(self) -> None:
        self.meter.stop()

    def _plan(self) -> MemoryPlan:
        saved = self._activations_peak()
        width = 2 if (self.config.fp16.enabled or self.config.bf16.enabled) else 4
        profile = None if saved is None else ActivationProfile(saved, self.config.train_micro_batch_size_per_gpu,
                                                               compute_bytes=width)
        return plan(ModelShape.of(self.module), self.config, self.dp_size, profile)

    def _log(self, check: PlanCheck) -> None:
        if self.rank != 0:
            return
        where = "allocated on the CPU" if check.on_cpu else "allocated on the device"
        log.info("memory at step %d (rank 0): planned peak %s, measured %s %s (planned/measured %.3f)\n%s",
                 CHECKED_STEP, binary_bytes(check.predicted), binary_bytes(check.measured), where, check.ratio,
                 check.planned.table())
