"""Where fp32 master weights and optimizer state live, and how the optimizer step runs there.

Orthogonal to the ZeRO stage that produced the shards: a strategy hands over its master slices,
their gradients and a write-back callback; the policy decides where the masters live and runs the
step. There is no `if offload:` outside this package.

- `OnDevice`: masters stay where the parameters are; one optimizer step.
- `HostOffload` (device "cpu"): masters and state in host memory, stepped by the CPU optimizer in
  sub-groups of `sub_group_size` elements. The gradients of sub-group k+1 are copied to the host
  (asynchronously on a GPU, on a copy stream of their own) while sub-group k is updated, and the updated
  16-bit parameters of k go back to the device while k+1 is updated.
- `NvmeOffload` (device "nvme"): as host offload, with masters and state in swap files between
  steps; the next sub-group is read while the current one is updated, and each updated sub-group is
  written back asynchronously.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from ..config.sections import AioConfig, OffloadOptimizerConfig
from .copies import CopyStream
from .nvme import NvmeSwapper, aligned_empty

WriteBack = Callable[[int], None]


class OnDevice:
    offloaded = False
    swaps_to_disk = False
    """`resident()` reads state in from swap files into buffers released when it exits."""

    def home(self, values: torch.Tensor) -> torch.nn.Parameter:
        return torch.nn.Parameter(values)

    def step(self, optimizer: torch.optim.Optimizer, masters: list[torch.Tensor], grads: list[torch.Tensor],
             write_back: WriteBack) -> None:
        for master, grad in zip(masters, grads):
            master.grad = grad if grad.dtype == master.dtype else grad.to(master.dtype)
        optimizer.step()
        for i, master in enumerate(masters):
            master.grad = None
            write_back(i)

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        """Called once the optimizer over the masters exists."""

    def resident(self) -> contextlib.AbstractContextManager:
        """Masters and optimizer state in memory for the duration (checkpoints read and write them)."""
        return contextlib.nullcontext()

    def close(self) -> None:
        """Release files and threads (NVMe)."""


def _sub_groups(numels: list[int], size: int) -> list[list[int]]:
    """Consecutive masters packed into groups of at most `size` elements (a larger one alone)."""
    groups: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(numels):
        if groups[-1] and used + n > size:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    return [g for g in groups if g]


class HostOffload(OnDevice):
    offloaded = True

    def __init__(self, cfg: OffloadOptimizerConfig, sub_group_size: int):
        self.pin = cfg.pin_memory and torch.cuda.is_available()
        self.sub_group_size = sub_group_size
        self.copies = CopyStream(self.pin)

    def home(self, values: torch.Tensor) -> torch.nn.Parameter:
        host = torch.empty(values.shape, dtype=torch.float32, pin_memory=self.pin)
        host.copy_(values)
        return torch.nn.Parameter(host)

    def _to_host(self, grads: list[torch.Tensor], indices: list[int]) -> tuple[list[torch.Tensor], object]:
        """Start copying these gradients to the host (on the copy stream, [Note: copy-stream ordering]); returns
        them and an event to wait on before reading them (None when the copies are done)."""
        return self.copies.to_host([grads[i] for i in indices], torch.float32)

    def step(self, optimizer: torch.optim.Optimizer, masters: list[torch.Tensor], grads: list[torch.Tensor],
             write_back: WriteBack) -> None:
        groups = _sub_groups([m.numel() for m in masters], self.sub_group_size)
        pending = self._to_host(grads, groups[0]) if groups else None
        for k, indices in enumerate(groups):
            host_grads, event = pending
            if k + 1 < len(groups):
                pending = self._to_host(grads, groups[k + 1])  # in flight while k is updated
            if event is not None:
                event.synchronize()
            self._update(optimizer, masters, indices, host_grads, write_back)

    def _update(self, optimizer: torch.optim.Optimizer, masters: list[torch.Tensor], indices: list[int],
                host_grads: list[torch.Tensor], write_back: WriteBack) -> None:
        for i, grad in zip(indices, host_grads):
            masters[i].grad = grad
        optimizer.step()  # torch optimizers skip parameters without a gradient: only this sub-group moves
        for i in indices:
            masters[i].grad = None
            write_back(i)


class NvmeOffload(HostOffload):
    """Masters and optimizer state in swap files between steps; at most two sub-groups resident."""

    swaps_to_disk = True

    def __init__(self, cfg: OffloadOptimizerConfig, sub_group_size: int, rank: int, aio: AioConfig):
        super().__init__(cfg, sub_group_size)
        self.swapper = NvmeSwapper(cfg.nvme_path, "offload_optimizer", rank, aio)
        self.masters: list[torch.nn.Parameter] = []
        self.numels: list[int] = []
        self.optimizer: torch.optim.Optimizer | None = None
        self._empty = torch.empty(0)

    def close(self) -> None:
        self.swapper.close()

    def home(self, values: torch.Tensor) -> torch.nn.Parameter:
        master = torch.nn.Parameter(values.detach().to("cpu", torch.float32).clone())
        self.swapper.allocate(f"master{len(self.masters)}", master.numel() * 4)
        self.masters.append(master)
        self.numels.append(master.numel())
        return master

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        """Once the optimizer over the masters exists: move the masters to their swap files."""
        self.optimizer = optimizer
        for i in range(len(self.masters)):
            self.swapper.wait(self._swap_out(i))
            self._release(i)

    def _state_keys(self, i: int) -> list[str]:
        state = self.optimizer.state.get(self.masters[i], {})
        return [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0]

    def _swap_out(self, i: int) -> list:
        master = self.masters[i]
        futures = self.swapper.write(f"master{i}", master.data)
        for key in self._state_keys(i):
            name = f"{key}{i}"
            if name not in self.swapper._sizes:
                self.swapper.allocate(name, self.numels[i] * 4)
            futures += self.swapper.write(name, self.optimizer.state[master][key])
        return futures

    def _swap_in(self, i: int) -> list:
        master = self.masters[i]
        master.data = aligned_empty(self.numels[i], torch.float32)
        futures = self.swapper.read(f"master{i}", master.data)
        for key in self._state_keys(i):
            self.optimizer.state[master][key] = aligned_empty(self.numels[i], torch.float32)
            futures += self.swapper.read(f"{key}{i}", self.optimizer.state[master][key])
        return futures

    def _release(self, i: int) -> None:
        for key in self._state_keys(i):
            self.optimizer.state[self.masters[i]][key] = self._empty
        self.masters[i].data = self._empty

    def step(self, optimizer: torch.optim.Optimizer, masters: list[torch.Tensor], grads: list[torch.Tensor],
             write_back: WriteBack) -> None:
        groups = _sub_groups(self.numels, self.sub_group_size)
        reads = [f for i in groups[0] for f in self._swap_in(i)] if groups else []
        writes: list = []
        previous: list[int] = []
        for k, indices in enumerate(groups):
            host_grads, event = self._to_host(grads, indices)
            self.swapper.wait(reads)
            if k + 1 < len(groups):  # read the next sub-group while this one is updated
                reads = [f for i in groups[k + 1] for f in self._swap_in(i)]
            if event is not None:
                event.synchronize()
            self._update(optimizer, masters, indices, host_grads, write_back)
            self.swapper.wait(writes)
            for i in previous:
                self._release(i)
            writes = [f for i in indices for f in self._swap_out(i)]
            previous = indices
        self.swapper.wait(writes)
        for i in previous:
            self._release(i)

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """Everything in host memory (for checkpoints), written back and released afterwards."""
        for i in range(len(self.masters)):
            self.swapper.wait(self._swap_in(i))
        try:
            yield
        finally:
            for i in range(len(self.masters)):
                self.swapper.wait(self._swap_out(i))
                self._release(i)


OptimizerOffload = OnDevice | HostOffload | NvmeOffload


def make_optimizer_offload(cfg: OffloadOptimizerConfig, sub_group_size: int, rank: int, aio: AioConfig) -> OptimizerOffload:
    if cfg.device == "cpu":
        return HostOffload(cfg, sub_group_size)
    if cfg.device == "nvme":
        return NvmeOffload(cfg, sub_group_size, rank, aio)
    return OnDevice()
