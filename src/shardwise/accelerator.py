"""The one place that knows CPU from CUDA: device, communication backend, synchronisation, memory."""

from __future__ import annotations

import os

import torch


def has_cuda() -> bool:
    return torch.cuda.is_available()


def backend() -> str:
    """NCCL on GPUs, gloo on CPU (gloo is also what CPU tests and CI use)."""
    return "nccl" if has_cuda() else "gloo"


def device_for(local_rank: int) -> torch.device:
    if has_cuda():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def set_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so that host timers measure it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory; on CPU the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cpu_threads_per_rank(local_world_size: int) -> int:
    """Split the host's cores between the ranks on it, so gloo ranks do not oversubscribe the CPU."""
    if "OMP_NUM_THREADS" in os.environ:
        return int(os.environ["OMP_NUM_THREADS"])
    return max(1, (os.cpu_count() or 1) // max(1, local_world_size))
