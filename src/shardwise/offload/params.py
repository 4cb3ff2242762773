"""Where ZeRO-3's parameter slices live between uses (`offload_param`): the device, host memory or
swap files. A unit asks its home for the slice on the device just before gathering it, and hands
updated values back after the optimizer step.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ..config.sections import AioConfig, OffloadParamConfig
from .copies import CopyStream
from .nvme import NvmeSwapper, aligned_empty


class ParamsOnDevice:
    offloaded = False
    swaps_to_disk = False
    """`resident()` reads state in from swap files into buffers released when it exits."""

    def resident(self, units: list) -> contextlib.AbstractContextManager:
        """Every unit's `shard` a real, writable tensor for the duration (checkpoints use it)."""
        return contextlib.nullcontext()

    def close(self) -> None:
        """Release files and threads (NVMe)."""

    def keep(self, index: int, shard: torch.Tensor) -> torch.Tensor:
        return shard

    def fetch(self, index: int, kept: torch.Tensor, device: torch.device) -> torch.Tensor:
        return kept

    def store(self, index: int, kept: torch.Tensor, values: torch.Tensor) -> None:
        if kept.data_ptr() != values.data_ptr():
            kept.copy_(values)


class ParamsOnHost(ParamsOnDevice):
    offloaded = True

    def __init__(self, cfg: OffloadParamConfig):
        self.pin = cfg.pin_memory and torch.cuda.is_available()
        self.copies = CopyStream(self.pin)

    def keep(self, index: int, shard: torch.Tensor) -> torch.Tensor:
        host = torch.empty(shard.shape, dtype=shard.dtype, pin_memory=self.pin)
        host.copy_(shard)
        return host

    def fetch(self, index: int, kept: torch.Tensor, device: torch.device) -> torch.Tensor:
        """On the copy stream when pinned ([Note: copy-stream ordering]): it overlaps the compute queued before."""
        return self.copies.to_device(kept, device)


class ParamsOnNvme(ParamsOnDevice):
    offloaded = True
    swaps_to_disk = True

    def __init__(self, cfg: OffloadParamConfig, rank: int, aio: AioConfig):
        self.swapper = NvmeSwapper(cfg.nvme_path, "offload_param", rank, aio)
        self._meta: dict[int, tuple[int, torch.dtype]] = {}

    def close(self) -> None:
        self.swapper.close()

    def keep(self, index: int, shard: torch.Tensor) -> torch.Tensor:
        name = f"param{index}"
        self.swapper.allocate(name, shard.numel() * shard.element_size())
        self.swapper.wait(self.swapper.write(name, shard.detach().cpu().contiguous()))
        self._meta[index] = (shard.numel(), shard.dtype)
        return torch.empty(0, dtype=shard.dtype)

    def fetch(self, index: int, kept: torch.Tensor, device: torch.device) -> torch.Tensor:
        numel, dtype = self._meta[index]
        if kept.numel():  # resident (see `resident`): the newest values are in memory
            return kept.to(device, copy=True)
        buffer = aligned_empty(numel, dtype)
        self.swapper.wait(self.swapper.read(f"param{index}", buffer))
        return buffer.to(device, copy=True)

    def store(self, index: int, kept: torch.Tensor, values: torch.Tensor) -> None:
        numel, dtype = self._meta[index]
        buffer = aligned_empty(numel, dtype)
        buffer.copy_(values)
        self.swapper.wait(self.swapper.write(f"param{index}", buffer))

    @contextlib.contextmanager
    def resident(self, units: list) -> Iterator[None]:
        kept = [u.shard for u in units]
        for unit in units:
            unit.shard = self.fetch(unit.index, unit.shard, torch.device("cpu"))
        try:
            yield
        finally:
            for unit, placeholder in zip(units, kept):
                self.store(unit.index, placeholder, unit.shard)
                unit.shard = placeholder


ParamHome = ParamsOnDevice | ParamsOnHost | ParamsOnNvme


def make_param_home(cfg: OffloadParamConfig, rank: int, aio: AioConfig) -> ParamHome:
    if cfg.device == "cpu":
        return ParamsOnHost(cfg)
    if cfg.device == "nvme":
        return ParamsOnNvme(cfg, rank, aio)
    return ParamsOnDevice()
