"""A swapped tensor is free once its futures are done, even while a worker thread still holds its finished
task (offload/nvme.py, [Note: swap buffers die with their last future]). Before, a loaded machine kept the
optimizer state written at the end of one step alive into the next step's peak (seen as a 6.2 MiB overshoot
of tests/distributed/test_memory_planner.py's stage2-offload-nvme case, 1 run in 20 under load)."""

from __future__ import annotations

import concurrent.futures
import gc
from pathlib import Path
from typing import Any, Callable

import torch

from shardwise.config.sections import AioConfig
from shardwise.offload.nvme import NvmeSwapper, aligned_empty


class KeepsEveryTask(concurrent.futures.Executor):
    """Runs each task at once and keeps it afterwards: the worst case of a thread that has not yet let go."""

    def __init__(self) -> None:
        self.tasks: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        self.tasks.append((fn, args))
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(fn(*args, **kwargs))
        return future


def _swapper(tmp_path: Path) -> NvmeSwapper:
    swapper = NvmeSwapper(str(tmp_path), "offload_optimizer", 0, AioConfig(block_size=4096))
    swapper.pool.shutdown()
    swapper.pool = KeepsEveryTask()
    return swapper


def _net_allocated(work: Callable[[], None]) -> int:
    """Bytes the CPU allocator handed out during `work` and did not get back."""
    from torch.profiler import ProfilerActivity, profile

    gc.collect()  # garbage from earlier tests in this process, freed inside `work` by its own collect, would count
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        work()
    return sum(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")


def test_a_written_tensor_is_freed_when_its_writes_are_done(tmp_path: Path) -> None:
    swapper = _swapper(tmp_path)
    swapper.allocate("state", 40_000)

    def write_and_drop() -> None:
        tensor = torch.arange(10_000, dtype=torch.float32)  # the storage the allocator hands out
        swapper.wait(swapper.write("state", tensor))
        del tensor
        gc.collect()

    assert _net_allocated(write_and_drop) == 0 and swapper.pool.tasks  # the tasks are kept, the storage is not
    back = aligned_empty(10_000, torch.float32)
    swapper.wait(swapper.read("state", back))
    assert torch.equal(back, torch.arange(10_000, dtype=torch.float32))
