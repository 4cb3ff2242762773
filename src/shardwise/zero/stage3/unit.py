"""A parameter unit: the direct parameters of one module, flattened and sharded across ranks.

[Note: stage-3 unit lifecycle] A unit is SHARDED (each rank keeps only its equal slice, `shard`),
GATHERING (an all-gather into `full` is in flight) or FULL (the module's parameters are views into
`full`). Every transition is checked. Releasing frees `full`'s storage (resized to 0 bytes, so views
that autograd saved for backward stay attached and see the data again after the next gather) and
points each parameter at an empty placeholder, so that reading a released parameter is a shape
error rather than a read of freed memory. A release that ends a `GatheredParameters` block instead hands
the gathered storage over to whatever still references it (the caller's `p.data` copies: freed with them)
and takes a fresh one (`keep_copies`).
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from ...distributed import Collectives, Group
from ...distributed.collectives import Pending
from ..flat_param import BucketLayout


class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    FULL = "full"


@dataclass
class LiveParams:
    """Elements of non-persistent units currently gathered (or being gathered), and the peak."""

    live: int = 0
    peak: int = 0
    gathers: int = 0
    releases: int = 0

    def add(self, numel: int) -> None:
        self.live += numel
        self.peak = max(self.peak, self.live)
        self.gathers += 1


@dataclass(eq=False)
class ParamUnit:
    index: int
    module_name: str
    params: list[torch.nn.Parameter]
    names: list[str]
    shapes: list[torch.Size]
    layout: BucketLayout
    shard: torch.Tensor
    """This rank's slice of the flat parameters, in the compute dtype."""
    group: Group
    comm: Collectives
    live: LiveParams
    persistent: bool = False
    """Small units stay gathered for the whole run (stage3_param_persistence_threshold)."""
    master: torch.Tensor | None = None
    """The fp32 master slice the optimizer steps (trainable units); `shard` itself in fp32 training."""
    home: Any = None
    """Where `shard` lives between uses (`offload/params.py`): the device, host memory or a swap file."""
    aliased: bool = False
    """`master` and `shard` are one tensor (fp32, nothing offloaded): no write-back after a step."""
    offload: Any = None
    """The optimizer-offload policy holding `master` (GatheredParameters may need it resident)."""
    device: torch.device | None = None
    """The compute device the full parameters are gathered on."""
    state: UnitState = UnitState.SHARDED
    users: int = 0
    _pending: Pending | None = None
    _source: torch.Tensor | None = None
    full: torch.Tensor = field(init=False)
    _views: list[torch.Tensor] = field(init=False)
    _placeholders: list[torch.Tensor] = field(init=False)

    def __post_init__(self) -> None:
        self.device = self.device or self.shard.device
        self._new_full()
        self._placeholders = [torch.empty(0, dtype=self.shard.dtype, device=self.device) for _ in self.params]
        for p, empty in zip(self.params, self._placeholders):
            p.data = empty

    def _new_full(self) -> None:
        """A fresh (storage-less until gathered) flat buffer, and the parameters' views into it."""
        self.full = torch.empty(self.layout.padded_numel, dtype=self.shard.dtype, device=self.device)
        self._views = [self.full[s.offset : s.offset + s.numel].view(shape) for s, shape in zip(self.layout.slots, self.shapes)]
        self.full.untyped_storage().resize_(0)

    @property
    def numel(self) -> int:
        return self.layout.padded_numel

    def index_of(self, param: torch.Tensor) -> int:
        return next(i for i, p in enumerate(self.params) if p is param)

    def name_of(self, param: torch.Tensor) -> str:
        return self.names[self.index_of(param)]

    def whole_shape(self, param: torch.Tensor) -> torch.Size:
        return self.shapes[self.index_of(param)]

    def local_part(self, param: torch.Tensor) -> torch.Tensor:
        """This rank's elements of `param` in the stored slice (flat; empty when none fall in it)."""
        start, end, at = self.layout.owned(self.layout.slots[self.index_of(param)], self.group.rank, self.group.size)
        return self.shard[at : at + end - start]

    def _expect(self, *states: UnitState) -> None:
        if self.state not in states:
            raise RuntimeError(f"ZeRO-3 unit {self.module_name!r}: is {self.state.value}, expected "
                               f"{' or '.join(s.value for s in states)}; the gather/release order is broken.")

    def gather_async(self) -> None:
        """Start the all-gather if the unit is sharded; a no-op when gathering or full."""
        if self.state is not UnitState.SHARDED:
            return
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        self._source = self.home.fetch(self.index, self.shard, self.full.device)  # alive until the gather is done
        self._pending = self.comm.all_gather(self.full, self._source, self.group)
        self.state = UnitState.GATHERING
        if not self.persistent:
            self.live.add(self.numel)

    def wait(self) -> None:
        """Block until full; afterwards the module's parameters hold the whole tensors."""
        self.gather_async()
        if self.state is UnitState.GATHERING:
            self._pending.wait()
            self._pending = self._source = None
            for p, view in zip(self.params, self._views):
                p.data = view
            self.state = UnitState.FULL

    def write_back(self) -> None:
        """After the optimizer step: the updated master slice becomes the stored 16-bit slice."""
        if self.master is not None and not self.aliased:
            self.home.store(self.index, self.shard, self.master.detach().to(self.shard.dtype))

    def release(self, force: bool = False, keep_copies: bool = False) -> None:
        """Free the full parameters (persistent units keep them unless `force`). With `keep_copies` the
        gathered storage is left to the tensors that still reference it instead of being freed in place."""
        if self.state is UnitState.SHARDED or (self.persistent and not force):
            return
        self._expect(UnitState.FULL)
        for p, empty in zip(self.params, self._placeholders):
            p.data = empty
        if keep_copies:
            self._new_full()
        else:
            self.full.untyped_storage().resize_(0)
        self.state = UnitState.SHARDED
        self.users = 0
        if not self.persistent:
            self.live.live -= self.numel
            self.live.releases += 1


@contextlib.contextmanager
def held(units: list[ParamUnit], keep_copies: bool = False) -> Iterator[None]:
    """The units gathered for the duration (a collective: every rank must hold the same units in the same
    order); afterwards each is released unless something else still holds it."""
    for unit in units:
        unit.users += 1
        unit.gather_async()
    try:
        for unit in units:
            unit.wait()
        yield
    finally:
        for unit in units:
            unit.users -= 1
            if unit.users <= 0:
                unit.release(keep_copies=keep_copies)
