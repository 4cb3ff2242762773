"""The one choke point every collective of the library passes through.

It counts calls and bytes per (op, group) — tests assert on these counts and the comms logger reads
them, with each message size's latency from issue to completed wait — and bounds every wait: a
collective that does not finish within the timeout becomes a `CollectiveTimeout` naming the rank, the
op, the group and the tensor shape, never a silent hang.
"""

from __future__ import annotations

import datetime
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from .topology import Group


# torch 2.13 renamed the flat-tensor collectives; older releases (>= 2.5) only have the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message carries `[rank r/W, <group> group]`."""


class CollectiveTimeout(CollectiveError):
    pass


@dataclass
class SizeStats:
    """Collectives of one message size: how many, and the summed issue → wait-complete latency of
    those whose wait has completed (an overlapped collective's latency includes the compute it hid)."""

    calls: int = 0
    waited: int = 0
    latency_s: float = 0.0


@dataclass
class OpStats:
    calls: int = 0
    elements: int = 0
    bytes: int = 0
    by_size: dict[int, SizeStats] = field(default_factory=lambda: defaultdict(SizeStats))


@dataclass
class CommStats:
    """Calls and payload per (op, group name), as issued by this rank."""

    ops: dict[tuple[str, str], OpStats] = field(default_factory=lambda: defaultdict(OpStats))
    group_sizes: dict[str, int] = field(default_factory=dict)
    synchronize: Callable[[], None] | None = None
    """Set by the comms logger on GPUs: waits for the device so latencies are device time, not launch time."""
    on_complete: Callable[[str, str, int, float], None] | None = None
    """Called with (op, group, bytes, seconds) when a collective's wait completes (the verbose comms log)."""

    def record(self, op: str, group: str, tensor: torch.Tensor, group_size: int | None = None) -> Callable[[], None]:
        """Count one collective; the returned callable, called when its wait completes, records its latency."""
        s = self.ops[(op, group)]
        nbytes = tensor.numel() * tensor.element_size()
        s.calls += 1
        s.elements += tensor.numel()
        s.bytes += nbytes
        if group_size is not None:
            self.group_sizes[group] = group_size
        by_size = s.by_size[nbytes]
        by_size.calls += 1
        start = time.perf_counter()

        def completed() -> None:
            if self.synchronize is not None:
                self.synchronize()
            seconds = time.perf_counter() - start
            by_size.waited += 1
            by_size.latency_s += seconds
            if self.on_complete is not None:
                self.on_complete(op, group, nbytes, seconds)

        return completed

    def calls(self, op: str, group: str | None = None) -> int:
        return sum(s.calls for (o, g), s in self.ops.items() if o == op and group in (None, g))

    def elements(self, op: str | None = None, group: str | None = None) -> int:
        return sum(s.elements for (o, g), s in self.ops.items() if op in (None, o) and group in (None, g))

    def reset(self) -> None:
        self.ops.clear()


class Pending:
    """An issued collective; `wait()` bounds the wait and turns failures into a named error."""

    def __init__(self, work: dist.Work | None, describe: str, timeout: datetime.timedelta,
                 completed: Callable[[], None] | None = None):
        self._work, self._describe, self._timeout = work, describe, timeout
        self._completed = completed

    def wait(self) -> None:
        on_done, self._completed = self._completed, None
        if self._work is None:
            if on_done is not None:
                on_done()
            return
        work, self._work = self._work, None
        try:
            completed = work.wait(timeout=self._timeout)
        except RuntimeError as e:
            kind = CollectiveTimeout if "timed out" in str(e).lower() else CollectiveError
            raise kind(f"{self._describe}: {e}") from e
        if completed is False:
            raise CollectiveTimeout(f"{self._describe}: did not complete within {self._timeout}")
        if on_done is not None:
            on_done()


class Collectives:
    """Issues collectives on a `Group`, counting them in `stats` and bounding waits by `timeout_s`."""

    def __init__(self, timeout_s: float = 1800.0, stats: CommStats | None = None):
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.stats = stats if stats is not None else CommStats()

    def _issue(self, op: str, group: Group, tensor: torch.Tensor, launch) -> Pending:
        completed = self.stats.record(op, group.name, tensor, group.size)
        describe = (
            f"[rank {dist.get_rank()}/{dist.get_world_size()}, {group.name} group] {op} of "
            f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"
        )
        if group.size == 1:
            return Pending(None, describe, self.timeout, completed)
        try:
            work = launch()
        except RuntimeError as e:
            raise CollectiveError(f"{describe}: {e}") from e
        return Pending(work, describe, self.timeout, completed)

    def all_reduce(self, tensor: torch.Tensor, group: Group, op: dist.ReduceOp = dist.ReduceOp.SUM) -> Pending:
        return self._issue("all_reduce", group, tensor,
                           lambda: dist.all_reduce(tensor, op=op, group=group.pg, async_op=True))

    def reduce_scatter(self, output: torch.Tensor, input_flat: torch.Tensor, group: Group) -> Pending:
        """Sum `input_flat` (group.size equal chunks) across ranks; this rank's chunk lands in `output`."""
        if group.size == 1:
            output.copy_(input_flat)
        return self._issue("reduce_scatter", group, input_flat,
                           lambda: _reduce_scatter(output, input_flat, group=group.pg, async_op=True))

    def all_gather(self, output_flat: torch.Tensor, shard: torch.Tensor, group: Group) -> Pending:
        """Concatenate every rank's `shard` into `output_flat`."""
        if group.size == 1:
            output_flat.copy_(shard)
        return self._issue("all_gather", group, output_flat,
                           lambda: _all_gather(output_flat, shard, group=group.pg, async_op=True))

    def broadcast(self, tensor: torch.Tensor, src_rank_in_group: int, group: Group) -> Pending:
        src = dist.get_global_rank(group.pg, src_rank_in_group)
        return self._issue("broadcast", group, tensor,
                           lambda: dist.broadcast(tensor, src=src, group=group.pg, async_op=True))
