"""Rank 0's console line every `steps_per_print` optimizer steps: step, loss, lr, loss scale, throughput."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("shardwise")


def ensure_console_handler() -> None:
    """Show shardwise's INFO lines when the user's script configured no logging of its own."""
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[shardwise] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


class ConsoleLog:
    """Accumulates samples and tokens between prints; rates are measured over the whole interval."""

    def __init__(self, steps_per_print: int, enabled: bool):
        self.every = steps_per_print
        self.enabled = enabled
        self._t0 = time.perf_counter()
        self._samples = 0
        self._tokens = 0
        self._loss_sum = 0.0
        self._loss_count = 0

    def on_step(self, step: int, loss: float, samples: int, tokens: int, lr: list[float], scale: float) -> None:
        self._samples += samples
        self._tokens += tokens
        self._loss_sum += loss
        self._loss_count += 1
        if step % self.every != 0:
            return
        dt = max(time.perf_counter() - self._t0, 1e-9)
        if self.enabled:
            lrs = ", ".join(f"{x:.3e}" for x in lr)
            logger.info(
                "step %d | loss %.4f | lr %s | loss scale %g | %.1f samples/s | %.0f tokens/s",
                step, self._loss_sum / self._loss_count, lrs, scale, self._samples / dt, self._tokens / dt,
            )
        self._t0 = time.perf_counter()
        self._samples = self._tokens = self._loss_count = 0
        self._loss_sum = 0.0
