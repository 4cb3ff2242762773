"""What the engine reports every `steps_per_print` optimizer steps, turned into monitor events.

Figures of the interval since the last report: rank 0's mean loss, the last step's lr (first
parameter group), loss scale and gradient norm, samples/s and tokens/s over all ranks, this rank's
achieved TFLOPS, peak memory, and (with `wall_clock_breakdown`) the mean time per step of each phase.

The rates need a timed interval: from the first forward the engine ran (a pipeline engine's first
`train_batch`), then from one report to the next. A first report with no such start (a script that calls
`engine.module(...)` itself, as DeepSpeed's GAN tutorial does) has no rates: the time its steps took is
unknown, and dividing by a guess printed rates like 4e9 samples/s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .. import accelerator
from .base import Event, FanOut

PREFIX = "Train/Samples/"


@dataclass(frozen=True)
class StepFigures:
    step: int
    """Optimizer steps done, this one included."""
    samples: int
    """Samples trained so far, all ranks (the x axis of the engine's events)."""
    loss: float | torch.Tensor
    """This rank's mean loss over the step's micro-batches; a tensor is read (a device sync) only at a report."""
    batch: int
    """Samples per optimizer step, all ranks."""
    tokens: int
    """Tokens of this step, all ranks (0 when the inputs carry no token ids)."""
    lr: list[float]
    loss_scale: float
    grad_norm: float | None


class StepReporter:
    def __init__(self, monitor: FanOut, steps_per_print: int, device: torch.device):
        self.monitor, self.every, self.device = monitor, steps_per_print, device
        self._start: float | None = None
        self._reset()

    def _reset(self) -> None:
        self._loss_sum: float | torch.Tensor = 0.0
        self._steps, self._samples, self._tokens = 0, 0, 0
        self._flops: float | None = 0.0

    def mark_start(self) -> None:
        """The first forward (or train_batch) starts the clock (set-up before it is no part of the first interval)."""
        if self._start is None:
            self._start = time.perf_counter()

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def on_step(self, figures: StepFigures, flops: float | None, timers_ms: dict[str, float]) -> list[Event]:
        """Account one optimizer step (`flops`: this rank's, None if unknown); at a report, write and
        return the events."""
        self._loss_sum = self._loss_sum + figures.loss
        self._steps += 1
        self._samples += figures.batch
        self._tokens += figures.tokens
        self._flops = None if flops is None or self._flops is None else self._flops + flops
        if not self.due(figures.step):
            return []
        events = self._events(figures, timers_ms)
        self.monitor.write_events(events)
        self._start = time.perf_counter()
        self._reset()
        return events

    def _events(self, f: StepFigures, timers_ms: dict[str, float]) -> list[Event]:
        values: dict[str, float] = {"train_loss": float(self._loss_sum) / self._steps, "lr": f.lr[0] if f.lr else 0.0,
                                    "loss_scale": f.loss_scale}
        if f.grad_norm is not None:
            values["grad_norm"] = f.grad_norm
        seconds = time.perf_counter() - self._start if self._start is not None else 0.0
        if seconds > 0.0:
            values["samples_per_sec"] = self._samples / seconds
            if self._tokens:
                values["tokens_per_sec"] = self._tokens / seconds
            if self._flops:
                values["tflops_per_rank"] = self._flops / seconds / 1e12
        values["peak_memory_mb"] = accelerator.peak_memory_bytes(self.device) / 2**20
        values.update({f"elapsed_time_ms_{name}": ms for name, ms in timers_ms.items()})
        return [(PREFIX + name, value, f.samples) for name, value in values.items()]
