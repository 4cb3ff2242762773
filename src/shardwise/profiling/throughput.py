"""`engine.tput_timer`: DeepSpeed's throughput counter (epochs, steps, samples/s since the warm-up).

Scripts written for DeepSpeed call `engine.tput_timer.update_epoch_count()` and read
`avg_samples_per_sec()`; the engine calls `step_done` after every optimizer step. The first
`start_step` steps are excluded from the average, as DeepSpeed does, so compilation and allocator
warm-up do not count.
"""

from __future__ import annotations

import time


class ThroughputTimer:
    def __init__(self, batch_size: int, start_step: int = 2):
        self.batch_size = batch_size
        self.start_step = start_step
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self._last: float | None = None

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def micro_step_done(self) -> None:
        self.micro_step_count += 1

    def step_done(self) -> None:
        now = time.perf_counter()
        self.global_step_count += 1
        if self._last is not None and self.global_step_count > self.start_step:
            self.total_elapsed_time += now - self._last
        self._last = now

    def avg_samples_per_sec(self) -> float:
        timed_steps = self.global_step_count - self.start_step
        if timed_steps <= 0 or self.total_elapsed_time <= 0:
            return float("-inf")  # DeepSpeed's value before any step was timed
        return self.batch_size * timed_steps / self.total_elapsed_time
