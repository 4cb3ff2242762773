"""Everything the engine does to be seen, behind one object, so the engine makes one call per phase:
`forward`, `backward`, `reduce` and `step` contexts, `on_step` with the step's figures.

Owns the monitor fan-out, the phase timers, the flops profiler, the comms logger, the activation
tracker and the (opt-in) progress line. With every switch off each context is one shared no-op:
training pays nothing to be watched.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, ContextManager, Iterator, Protocol

import torch

from ..config import Config
from ..distributed import Collectives
from ..monitor.base import FanOut
from ..monitor.build import build_monitor
from ..monitor.progress import progress_from_env
from ..monitor.reporter import PREFIX, StepFigures, StepReporter
from ..protocols import ShardingStrategy
from .activations import ActivationTracker
from .comms import CommsLogger
from .flops_profiler import FlopsProfiler
from .memory import MemoryBreakdown, memory_breakdown
from .noop import NOTHING
from .timers import StepTimers

logger = logging.getLogger("shardwise")


class StepListener(Protocol):
    def on_step(self, figures: StepFigures) -> None: ...

    def close(self) -> None: ...


class Instruments:
    def __init__(self, config: Config, strategy: ShardingStrategy, comm: Collectives, device: torch.device, rank: int,
                 dp_size: int):
        self.monitor: FanOut = build_monitor(config, rank)
        self.timers = StepTimers(config.wall_clock_breakdown, device)
        self.flops_profiler = FlopsProfiler(config.flops_profiler, device, rank)
        self.comms_logger = CommsLogger(config.comms_logger, comm.stats, device, rank)
        self.activations = ActivationTracker(config.memory_breakdown)
        self.reporter = StepReporter(self.monitor, config.steps_per_print, device)
        self.progress = progress_from_env(rank)
        self.strategy, self.device, self.rank, self.dp_size = strategy, device, rank, dp_size
        self.stage = config.zero_optimization.stage
        self.step_listeners: list[StepListener] = []
        """Told of every optimizer step, closed with the instruments: the planner's check and an autotuning
        experiment's report, which sit above profiling and are attached by the runtime (runtime/watchers.py)."""
        self.log_memory = config.memory_breakdown
        # The 6·N·tokens estimate of a step's FLOPs (forward 2N, backward 4N per token) until a profile exists.
        self._flops_per_token = 6 * sum(p.numel() for p in strategy.module.parameters() if p.requires_grad)
        self._micro_batches = 0
        self._figures: StepFigures | None = None
        self._deferring = False

    # --- phases ------------------------------------------------------------------------------
    def forward(self, module: torch.nn.Module, global_steps: int) -> ContextManager[None]:
        self._micro_batches += 1
        self.reporter.mark_start()
        profiled = self.flops_profiler.forward(module, global_steps)
        if not self.timers.enabled and not self.activations.wanted and profiled is NOTHING:
            return NOTHING
        return _all(self.timers("forward"), profiled, self.activations.track(module))

    def backward(self) -> ContextManager[None]:
        profiled = self.flops_profiler.backward()
        if not self.timers.enabled and profiled is NOTHING:
            return NOTHING
        return _all(self.timers("backward"), profiled)

    def reduce(self) -> ContextManager[None]:
        """Around the strategy's `finish_backward`: the wait for gradient reduction backward did not hide."""
        return self.timers("backward_reduce")

    def allgather(self) -> ContextManager[None]:
        """Around the strategy's `sync_params`: gathering updated parameters after the optimizer step."""
        return self.timers("step_allgather")

    def step(self, boundary: bool) -> ContextManager[None]:
        """Around `engine.step()`; the step is reported after its own time is measured."""
        profiled = self.flops_profiler.step() if boundary else NOTHING
        if not self.timers.enabled and profiled is NOTHING:
            return NOTHING  # `on_step` reports at once: there is no time of the step's to wait for
        return self._measured_step(profiled)

    @contextlib.contextmanager
    def _measured_step(self, profiled: ContextManager[None]) -> Iterator[None]:
        # The profiler's context is outermost so that printing its report is not timed as the step.
        self._deferring = True
        try:
            with _all(profiled, self.timers("step")):
                yield
        finally:
            self._deferring = False
        if self._figures is not None:
            figures, self._figures = self._figures, None
            self._report(figures)

    def on_step(self, figures: StepFigures) -> None:
        """An optimizer step was taken: reported now, or when a measured `step` context closes."""
        for listener in self.step_listeners:
            listener.on_step(figures)
        if self._deferring:
            self._figures = figures
        else:
            self._report(figures)

    # --- reports -----------------------------------------------------------------------------
    def _report(self, figures: StepFigures) -> None:
        self.timers.step_done()
        due = self.reporter.due(figures.step)
        timers_ms = {k: v * 1e3 for k, v in self.timers.take_means().items()} if due and self.timers.enabled else {}
        self.reporter.on_step(figures, self._step_flops(figures), timers_ms)
        if self.progress is not None:
            self.progress.update(figures)
        if due and self.log_memory:
            self._report_memory(figures.samples)

    def _step_flops(self, figures: StepFigures) -> float | None:
        """This rank's FLOPs in the step: measured per micro-batch once profiled, else 6·N·tokens."""
        micro_batches, self._micro_batches = self._micro_batches, 0
        profile = self.flops_profiler.profile
        if profile is not None and profile.bwd_flops:
            return float(profile.flops * micro_batches)
        if figures.tokens:
            return float(self._flops_per_token * figures.tokens / self.dp_size)
        return None

    def _report_memory(self, samples: int) -> None:
        mem = self.memory_breakdown()
        mb = 2.0**20
        values = {"parameters": mem.parameters.total, "frozen_parameters": mem.frozen_parameters.total,
                  "master_weights": mem.master_weights.total,
                  "gradients": mem.gradients.total, "optimizer_state": mem.optimizer_state.total,
                  "buffers": mem.buffers.total}
        if mem.activations_peak is not None:
            values["activations_peak"] = mem.activations_peak
        self.monitor.write_events([(f"{PREFIX}memory_{k}_mb", v / mb, samples) for k, v in values.items()])

    def comms_summary(self) -> str:
        return self.comms_logger.summary()

    def memory_breakdown(self) -> MemoryBreakdown:
        return memory_breakdown(self.strategy, self.device, self.stage, self.dp_size, self.activations.peak)

    def close(self) -> None:
        self.monitor.close()
        for listener in self.step_listeners:
            listener.close()
        if self.progress is not None:
            self.progress.close()


@contextlib.contextmanager
def _all(*contexts: ContextManager[Any]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield
