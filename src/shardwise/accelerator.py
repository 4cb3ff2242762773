"""The one place that knows CPU from CUDA: device, communication backend, synchronisation, memory."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

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


@dataclass(frozen=True)
class MemoryHeadroom:
    """How many more bytes a rank could allocate where it computes, what binds them, and whether the node's
    ranks share them (host memory does)."""

    bytes: int
    bound_by: str
    shared: bool = False
    outside_allocator: int = 0
    """Of the capacity, what a config must leave for mappings the tensor allocator does not make (see
    `ADDRESS_SPACE_OUTSIDE_ALLOCATOR`)."""


ADDRESS_SPACE_OUTSIDE_ALLOCATOR = 64 * 2**20
"""Under an address-space rlimit, every mapping counts, not only tensors: glibc reserves 64 MiB of address space
for a thread's malloc arena, oneDNN maps its kernels and scratch, and freed memory glibc keeps stays mapped. On
the OOM test's model (demo GPT, 4 layers of 256) a whole step at micro-batch 2, 4 and 8 grew VmSize by 56, 51-54
and 77-93 MiB more than the planned tensors; a micro-batch-2 step under the limit needed 50-70 MiB above VmSize,
for a plan of 47 MiB more tensors. So a config proposed under this bound must leave 64 MiB of it free."""


def memory_headroom(device: torch.device) -> MemoryHeadroom:
    """On CUDA what is free on the device plus torch's unused cache; on CPU the tightest of the host's
    available memory, the cgroup's limit and the address-space rlimit."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return MemoryHeadroom(torch.cuda.mem_get_info(device)[0] + cached, "free on the device plus torch's unused cache")
    import resource

    bounds = [MemoryHeadroom(_meminfo_bytes("MemAvailable"), "the host's available memory", shared=True)]
    try:
        with open("/sys/fs/cgroup/memory.max") as f, open("/sys/fs/cgroup/memory.current") as g:
            limit = f.read().strip()
            if limit != "max":
                bounds.append(MemoryHeadroom(int(limit) - int(g.read()), "the cgroup's memory.max", shared=True))
    except (OSError, ValueError):
        pass
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft != resource.RLIM_INFINITY:
        bounds.append(MemoryHeadroom(soft - _status_bytes("VmSize"), "the address-space rlimit (ulimit -v)",
                                     outside_allocator=ADDRESS_SPACE_OUTSIDE_ALLOCATOR))
    return min(bounds, key=lambda b: b.bytes)


def memory_capacity(device: torch.device, local_ranks: int) -> int:
    """The most one rank can hold where it computes: a GPU's memory, or its share of the host's (bounded by the
    cgroup's limit where one is set)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    host = _meminfo_bytes("MemTotal")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        host = min(host, int(limit)) if limit != "max" else host
    except (OSError, ValueError):
        pass
    return host // max(local_ranks, 1)


def _meminfo_bytes(key: str) -> int:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields[key].split()[0]) * 1024


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return int(fields[key].split()[0]) * 1024


def cpu_threads_per_rank(local_world_size: int) -> int:
    """Split the host's cores between the ranks on it, so gloo ranks do not oversubscribe the CPU."""
    if "OMP_NUM_THREADS" in os.environ:
        return int(os.environ["OMP_NUM_THREADS"])
    return max(1, (os.cpu_count() or 1) // max(1, local_world_size))


class Accelerator:
    """DeepSpeed's accelerator object (`get_accelerator()`): the device API scripts written for DeepSpeed
    call, answered from torch for this machine's device type (CUDA when a GPU is visible, else CPU).
    On CPU, memory figures are the process's resident set, as DeepSpeed's CPU accelerator reports them."""

    def __init__(self) -> None:
        self._name = "cuda" if has_cuda() else "cpu"
        self._compile_backend = "inductor"
        self._peak_rss = 0

    # --- devices ------------------------------------------------------------------------------
    def is_available(self) -> bool:
        return True

    def device_name(self, device_index: int | None = None) -> str:
        if self._name == "cpu" or device_index is None:
            return self._name
        return f"cuda:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device | None:
        return torch.device("cuda", device_index or 0) if self._name == "cuda" else None

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._name == "cuda" else int(os.environ.get("LOCAL_RANK", 0))

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._name == "cuda" else "cpu"

    def device_count(self) -> int:
        if self._name == "cuda":
            return torch.cuda.device_count()
        return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", 1)))

    def set_device(self, device_index: int | str | torch.device) -> None:
        if self._name == "cuda":
            torch.cuda.set_device(device_index)

    def synchronize(self, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.synchronize(device_index)

    def is_synchronized_device(self) -> bool:
        return self._name == "cpu"

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def communication_backend_name(self) -> str:
        return backend()

    # --- precision ----------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._name == "cuda" else True

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.float16, *([torch.bfloat16] if self.is_bf16_supported() else [])]

    def is_triton_supported(self) -> bool:
        return False

    # --- random numbers -----------------------------------------------------------------------
    def random(self) -> object:
        return torch.random

    def manual_seed(self, seed: int) -> None:
        if self._name == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        if self._name == "cuda":
            torch.cuda.manual_seed_all(seed)
        else:  # DeepSpeed's CPU accelerator seeds torch's one generator here too
            torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._name == "cuda" else torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.cuda.get_rng_state(device_index or "cuda") if self._name == "cuda" else torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.set_rng_state(new_state, device_index or "cuda")
        else:
            torch.set_rng_state(new_state)

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.cuda.default_generators[device_index] if self._name == "cuda" else torch.default_generator

    # --- memory -------------------------------------------------------------------------------
    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        self._peak_rss = max(self._peak_rss, rss)
        return rss

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._name == "cuda" else self._rss()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        if self._name == "cuda":
            return torch.cuda.max_memory_allocated(device_index)
        self._rss()
        return self._peak_rss

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._name == "cuda" else self._rss()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index) if self._name == "cuda" else self.max_memory_allocated()

    memory_cached = memory_reserved
    max_memory_cached = max_memory_reserved

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.reset_peak_memory_stats(device_index)
        else:
            self._peak_rss = 0
            self._rss()

    reset_max_memory_allocated = reset_peak_memory_stats
    reset_max_memory_cached = reset_peak_memory_stats

    def memory_stats(self, device_index: int | None = None) -> dict[str, int]:
        if self._name == "cuda":
            return torch.cuda.memory_stats(device_index)
        return {"allocated_bytes.all.current": self._rss(), "allocated_bytes.all.peak": self._peak_rss}

    def total_memory(self, device_index: int | None = None) -> int:
        if self._name == "cuda":
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    def available_memory(self, device_index: int | None = None) -> int:
        if self._name == "cuda":
            return torch.cuda.mem_get_info(device_index)[0]
        return _meminfo_bytes("MemAvailable")

    def empty_cache(self) -> None:
        if self._name == "cuda":
            torch.cuda.empty_cache()

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._name == "cuda" else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    # --- streams, events, profiling ranges ------------------------------------------------------
    @property
    def Stream(self) -> type | None:  # noqa: N802 - DeepSpeed's name
        return torch.cuda.Stream if self._name == "cuda" else None

    @property
    def Event(self) -> type | None:  # noqa: N802 - DeepSpeed's name
        return torch.cuda.Event if self._name == "cuda" else None

    def stream(self, stream: object) -> object:
        import contextlib

        return torch.cuda.stream(stream) if self._name == "cuda" else contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> object:
        return torch.cuda.current_stream(device_index) if self._name == "cuda" else None

    def default_stream(self, device_index: int | None = None) -> object:
        return torch.cuda.default_stream(device_index) if self._name == "cuda" else None

    def range_push(self, msg: str) -> None:
        if self._name == "cuda":
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        if self._name == "cuda":
            torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: object) -> object:
        return torch.cuda._lazy_call(callback) if self._name == "cuda" else callback()  # type: ignore[operator]

    # --- compilation and native ops ----------------------------------------------------------------
    def get_compile_backend(self) -> str:
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        self._compile_backend = backend

    def create_op_builder(self, op_name: str) -> None:
        """shardwise builds no native ops (its kernels are torch's); DeepSpeed scripts that ask get None,
        which DeepSpeed also answers for an op its accelerator lacks."""
        return None

    def get_op_builder(self, class_name: str) -> None:
        return None

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"]

    def set_visible_devices_envs(self, current_env: dict[str, str], local_accelerator_ids: list[int]) -> None:
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def export_envs(self) -> list[str]:
        return ["NCCL"] if self._name == "cuda" else []


@functools.cache
def get_accelerator() -> Accelerator:
    """The process's accelerator object (DeepSpeed's `get_accelerator()`); one per process, as there."""
    return Accelerator()
