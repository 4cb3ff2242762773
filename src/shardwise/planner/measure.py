"""Measured peak memory: what the planner's predictions are checked against.

[Note: measuring a CPU peak] On CUDA the caching allocator keeps the peak (`max_memory_allocated`). The CPU
allocator keeps no statistics, so `AllocationMeter` runs torch's profiler with `profile_memory`, which records
every allocation and free of the CPU allocator (storage resizes included) with its time. The bytes live at any
moment are the bytes live when the meter started (`baseline`, counted by the caller) plus the running sum of
those records; the peak of a window is the largest running sum inside it. This is the same quantity as CUDA's
allocated peak: tensor storage, not the process's RSS.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class AllocationMeter:
    """Peak bytes allocated on `device` in windows opened with `mark()` (see [Note: measuring a CPU peak])."""

    def __init__(self, device: torch.device | str = "cpu", baseline: int = 0):
        self.device = torch.device(device)
        self.baseline = baseline
        self._profile: Any = None
        self._records: list[tuple[int, int]] | None = None

    def start(self) -> AllocationMeter:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()
        return self

    def mark(self) -> int:
        """A window's start: the peak of `peak_since(mark)` counts from here."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return time.time_ns()

    def stop(self) -> None:
        if self._profile is None:
            return
        self._profile.__exit__(None, None, None)
        events = self._profile.profiler.kineto_results.events()
        self._records = sorted((e.start_ns(), e.nbytes()) for e in events
                               if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
        self._profile = None

    def peak_since(self, mark: int) -> int:
        """Largest bytes live on the device after `mark` (the meter must be stopped on CPU)."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        if self._records is None:
            raise RuntimeError("AllocationMeter.peak_since: stop() the meter first; the profiler's records are "
                               "read when it stops.")
        # The profiler stamps its records in wall-clock nanoseconds since the epoch, as time.time_ns reads.
        live, peak = self.baseline, None
        for at, nbytes in self._records:
            if at >= mark and peak is None:
                peak = live
            live += nbytes
            if peak is not None:
                peak = max(peak, live)
        return live if peak is None else peak
