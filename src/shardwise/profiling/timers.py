"""Wall-clock timers of a training step's phases (`wall_clock_breakdown`).

The engine wraps its phases in `timers("forward")`, `timers("backward")`, `timers("backward_reduce")`,
`timers("step")`; a strategy may time its own (`"all_gather"`). Times add up over the micro-steps of an
optimizer step and over the steps between two reports; `take_means()` returns the mean per optimizer
step and starts a new interval.

[Note: timer synchronization] On a GPU, work is queued, not done, when Python returns; each timer
synchronizes the device when it starts and stops so that it measures the work of its own phase.
Those synchronizations are why the timers are off unless asked for: off, `timers(name)` returns one
shared no-op context and costs a method call.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import ContextManager, Iterator

import torch

from .. import accelerator
from .noop import NOTHING

PHASES = ("forward", "backward", "backward_reduce", "step", "step_allgather")
"""The engine's phases; `backward_reduce` is inside `backward` (the wait for gradient reduction after
the last gradient is produced: the communication that backward did not hide); `step_allgather` is
inside `step` (ZeRO-1/2 gathering the updated parameter slices)."""

class StepTimers:
    def __init__(self, enabled: bool, device: torch.device):
        self.enabled = enabled
        self.device = device
        self._total_s: dict[str, float] = defaultdict(float)
        self._steps = 0

    def __call__(self, name: str) -> ContextManager[None]:
        return self._timed(name) if self.enabled else NOTHING

    @contextlib.contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        accelerator.synchronize(self.device)  # see [Note: timer synchronization]
        start = time.perf_counter()
        try:
            yield
        finally:
            accelerator.synchronize(self.device)
            self._total_s[name] += time.perf_counter() - start

    def step_done(self) -> None:
        """One optimizer step ended (its micro-steps' times belong to it)."""
        self._steps += 1

    def take_means(self) -> dict[str, float]:
        """Mean seconds per optimizer step of each timed phase since the last call; resets."""
        steps = max(self._steps, 1)
        means = {name: total / steps for name, total in self._total_s.items()}
        self._total_s.clear()
        self._steps = 0
        return means
