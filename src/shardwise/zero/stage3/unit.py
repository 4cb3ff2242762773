"""A parameter unit: the direct parameters of one module, flattened and sharded across ranks.

[Note: stage-3 unit lifecycle] A unit is SHARDED (each rank keeps only its equal slice, `shard`),
GATHERING (an all-gather into `full` is in flight) or FULL (the module's parameters are views into
`full`). Every transition is checked. Releasing frees `full`'s storage (resized to 0 bytes, so views
that autograd saved for backward stay attached and see the data again after the next gather) and
points each parameter at an empty placeholder, so that reading a released parameter is a shape
error rather than a read of freed memory. A release that ends a `GatheredParameters` block instead hands
the gathered storage over to whatever still references it (the caller's `p.data` copies: freed with them)
and takes a fresh one (`keep_copies`).

[Note: a unit of one] In a group of one whose slice stays on the device (no `offload_param`), the slice is the
whole flat buffer: `full` is `shard` itself (`whole`). Gathering only points the parameters at it and releasing
points them away; nothing is copied or freed, and the weights the compute reads are the ones the optimizer steps.

[Note: approximate gathers] The gathers the forward and backward hooks make may take two shortcuts
(`approximate=True`), both ZeRO++'s: with a secondary group (hpZ) the first gather after a step keeps this
rank's 1/size of the whole weights, and the gathers after it, until the next step, assemble them from the
node's ranks only; with `quant` (qwZ) a gather across the data group travels as int8 blocks, so the compute
sees the dequantized weights (the masters stay exact). Every other gather (checkpoints, `GatheredParameters`,
whole weights, the persistent units) is exact, and a unit gathered approximately is regathered exactly for it
when nothing holds it.
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
from ..quantized_comm import quantized_all_gather


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
    released: set[ParamUnit] = field(default_factory=set)
    """The units released since the prefetcher last looked (`Stage3Hooks._prefetch`); at most one entry per unit."""

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
    replica: int = 0
    """Which node's copy this is, for a frozen unit partitioned within nodes (checkpoints write copy 0)."""
    secondary_group: Group | None = None
    """ZeRO++ hpZ: the node's ranks that approximate gathers assemble from ([Note: approximate gathers])."""
    quant: Any = None
    """ZeRO++ qwZ: the `BlockQuant` approximate gathers across `group` travel in, or None."""
    whole: bool = False
    """`full` is `shard` itself ([Note: a unit of one]): a group of one, the slice on the device."""
    state: UnitState = UnitState.SHARDED
    exact: bool = True
    """The full parameters (when gathering or full) are the stored values, not an approximation of them."""
    users: int = 0
    _pending: Pending | None = None
    _source: torch.Tensor | None = None
    secondary: torch.Tensor | None = None
    """hpZ's kept block of the whole weights, while valid (None after a step or a load)."""
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
        """A fresh (storage-less until gathered) flat buffer, and the parameters' views into it; for a `whole` unit
        the slice itself."""
        if self.whole:
            self.full = self.shard
        else:
            self.full = torch.empty(self.layout.padded_numel, dtype=self.shard.dtype, device=self.device)
        self._views = [self.full[s.offset : s.offset + s.numel].view(shape) for s, shape in zip(self.layout.slots, self.shapes)]
        if not self.whole:
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

    def gather_async(self, approximate: bool = False) -> None:
        """Start the all-gather if the unit is sharded; a no-op when gathering or full. `approximate` allows
        ZeRO++'s shortcuts ([Note: approximate gathers])."""
        if self.state is UnitState.SHARDED:
            self._start(approximate)
            if self.state is UnitState.GATHERING and self._plain(approximate):
                self._pending = self.comm.all_gather(self.full, self._source, self.group)

    def _plain(self, approximate: bool) -> bool:
        """Whether its gather is an exact all-gather of the stored slice over `group` (which may share a coalesced
        collective with other units'), not one of ZeRO++'s shortcuts."""
        return not (approximate and not self.persistent and (self.secondary is not None or self.quant is not None))

    def _start(self, approximate: bool) -> None:
        """SHARDED -> GATHERING: the storage, the source and the count; a shortcut gather is issued here, a plain
        one by the caller (`gather_units`), into `_pending`. A `whole` unit is FULL at once."""
        if self.whole:
            if not self.persistent:
                self.live.add(self.numel)
            for p, view in zip(self.params, self._views):
                p.data = view
            self.state = UnitState.FULL
            return
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        approximate = approximate and not self.persistent
        if approximate and self.secondary is not None:
            self._pending = self.comm.all_gather(self.full, self.secondary, self.secondary_group)
        else:
            self._source = self.home.fetch(self.index, self.shard, self.full.device)  # alive until the gather is done
            if approximate and self.quant is not None:
                self._pending = quantized_all_gather(self.comm, self.full, self._source, self.group, self.quant)
        self.exact = not approximate or self.quant is None
        self.state = UnitState.GATHERING
        if not self.persistent:
            self.live.add(self.numel)

    def wait(self, approximate: bool = False) -> None:
        """Block until full; afterwards the module's parameters hold the whole tensors."""
        if self.state is UnitState.SHARDED:
            self.gather_async(approximate)
        if self.state is UnitState.GATHERING:
            self._pending.wait()
            self._pending = self._source = None
            if self.secondary_group is not None and self.secondary is None and not self.persistent:
                lo, hi = self.layout.shard_range(self.secondary_group.rank, self.secondary_group.size)
                self.secondary = self.full[lo:hi].clone()
            for p, view in zip(self.params, self._views):
                p.data = view
            self.state = UnitState.FULL

    def drop_secondary(self) -> None:
        """The stored values changed (a step, a load): the next gather comes from the primary slices."""
        self.secondary = None

    def discard_gathered(self) -> None:
        """The stored values changed: free every gathered copy, persistent ones and hpZ's block included (a `whole`
        unit has none: its parameters read the stored values)."""
        if self.whole:
            return
        self.release(force=True)
        self.drop_secondary()

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
        if self.whole:
            pass  # the slice: what the caller took from it stays valid as it is
        elif keep_copies:
            self._new_full()
        else:
            self.full.untyped_storage().resize_(0)
        self.state = UnitState.SHARDED
        self.users = 0
        if not self.persistent:
            self.live.live -= self.numel
            self.live.releases += 1
            self.live.released.add(self)


def gather_units(units: list[ParamUnit], approximate: bool = False) -> None:
    """Start the gathers of the sharded `units`, in order (the same on every rank). Consecutive plain gathers over
    one group travel as one coalesced collective: on shared memory the units' slices share pieces, so a run of
    small units costs fewer synchronisations than one each, and each unit is whole as soon as its own part is."""
    batch: list[ParamUnit] = []
    for unit in units:
        if unit.state is not UnitState.SHARDED:
            continue
        plain = unit._plain(approximate)
        if batch and not (plain and unit.group is batch[0].group and unit.comm is batch[0].comm):
            _issue_gathers(batch)
            batch = []
        unit._start(approximate)
        if plain and unit.state is UnitState.GATHERING:
            batch.append(unit)
    if batch:
        _issue_gathers(batch)


def _issue_gathers(batch: list[ParamUnit]) -> None:
    first = batch[0]
    if len(batch) == 1:
        first._pending = first.comm.all_gather(first.full, first._source, first.group)
        return
    pending = first.comm.all_gather_coalesced([u.full for u in batch], [u._source for u in batch], first.group)
    for unit, p in zip(batch, pending):
        unit._pending = p


@contextlib.contextmanager
def held(units: list[ParamUnit], keep_copies: bool = False) -> Iterator[None]:
    """The units gathered for the duration (a collective: every rank must hold the same units in the same
    order); afterwards each is released unless something else still holds it."""
    for unit in units:
        if not unit.exact and unit.users == 0 and unit.state is not UnitState.SHARDED:
            unit.wait()
            unit.release()  # gathered for the forward, approximately: gather the stored values instead
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
