"""The one choke point every collective of the library passes through.

It counts calls and bytes per (op, group) — tests assert on these counts and the comms logger reads
them — and bounds every wait: a collective that does not finish within the timeout becomes a
`CollectiveTimeout` naming the rank, the op, the group and the tensor shape, never a silent hang.
"""

from __future__ import annotations

import datetime
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .topology import Group


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message carries `[rank r/W, <group> group]`."""


class CollectiveTimeout(CollectiveError):
    pass


@dataclass
class OpStats:
    calls: int = 0
    elements: int = 0
    bytes: int = 0


@dataclass
class CommStats:
    """Calls and payload per (op, group name), as issued by this rank."""

    ops: dict[tuple[str, str], OpStats] = field(default_factory=lambda: defaultdict(OpStats))

    def record(self, op: str, group: str, tensor: torch.Tensor) -> None:
        s = self.ops[(op, group)]
        s.calls += 1
        s.elements += tensor.numel()
        s.bytes += tensor.numel() * tensor.element_size()

    def calls(self, op: str, group: str | None = None) -> int:
        return sum(s.calls for (o, g), s in self.ops.items() if o == op and group in (None, g))

    def elements(self, op: str | None = None, group: str | None = None) -> int:
        return sum(s.elements for (o, g), s in self.ops.items() if op in (None, o) and group in (None, g))

    def reset(self) -> None:
        self.ops.clear()


class Pending:
    """An issued collective; `wait()` bounds the wait and turns failures into a named error."""

    def __init__(self, work: dist.Work | None, describe: str, timeout: datetime.timedelta):
        self._work, self._describe, self._timeout = work, describe, timeout

    def wait(self) -> None:
        if self._work is None:
            return
        work, self._work = self._work, None
        try:
            completed = work.wait(timeout=self._timeout)
        except RuntimeError as e:
            kind = CollectiveTimeout if "timed out" in str(e).lower() else CollectiveError
            raise kind(f"{self._describe}: {e}") from e
        if completed is False:
            raise CollectiveTimeout(f"{self._describe}: did not complete within {self._timeout}")


class Collectives:
    """Issues collectives on a `Group`, counting them in `stats` and bounding waits by `timeout_s`."""

    def __init__(self, timeout_s: float = 1800.0, stats: CommStats | None = None):
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.stats = stats if stats is not None else CommStats()

    def _issue(self, op: str, group: Group, tensor: torch.Tensor, launch) -> Pending:
        self.stats.record(op, group.name, tensor)
        describe = (
            f"[rank {dist.get_rank()}/{dist.get_world_size()}, {group.name} group] {op} of "
            f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"
        )
        if group.size == 1:
            return Pending(None, describe, self.timeout)
        try:
            work = launch()
        except RuntimeError as e:
            raise CollectiveError(f"{describe}: {e}") from e
        return Pending(work, describe, self.timeout)

    def all_reduce(self, tensor: torch.Tensor, group: Group, op: dist.ReduceOp = dist.ReduceOp.SUM) -> Pending:
        return self._issue("all_reduce", group, tensor,
                           lambda: dist.all_reduce(tensor, op=op, group=group.pg, async_op=True))

    def reduce_scatter(self, output: torch.Tensor, input_flat: torch.Tensor, group: Group) -> Pending:
        """Sum `input_flat` (group.size equal chunks) across ranks; this rank's chunk lands in `output`."""
        if group.size == 1:
            output.copy_(input_flat)
        return self._issue("reduce_scatter", group, input_flat,
                           lambda: dist.reduce_scatter_tensor(output, input_flat, group=group.pg, async_op=True))

    def all_gather(self, output_flat: torch.Tensor, shard: torch.Tensor, group: Group) -> Pending:
        """Concatenate every rank's `shard` into `output_flat`."""
        if group.size == 1:
            output_flat.copy_(shard)
        return self._issue("all_gather", group, output_flat,
                           lambda: dist.all_gather_into_tensor(output_flat, shard, group=group.pg, async_op=True))

    def broadcast(self, tensor: torch.Tensor, src_rank_in_group: int, group: Group) -> Pending:
        src = dist.get_global_rank(group.pg, src_rank_in_group)
        return self._issue("broadcast", group, tensor,
                           lambda: dist.broadcast(tensor, src=src, group=group.pg, async_op=True))
