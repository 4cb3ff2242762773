"""The one choke point every collective of the library passes through.

It counts calls and bytes per (op, group) — tests assert on these counts and the comms logger reads
them, with each message size's latency from issue to completed wait — numbers them per group ("call #57",
the same on every rank) and bounds every wait: a collective still pending after `warn_after_s` logs which
ranks have not arrived, and one that does not finish within the timeout becomes a `CollectiveTimeout`
naming the rank, the op, the group, the tensor shape and the ranks that never arrived, never a silent hang
(`pending.py`; who arrived comes from the shared-memory headers or from `progress.py`).

CPU tensors of a gloo group whose ranks share a host go through shared memory (`shm.py`): a third to a
fifth of gloo's CPU time (benchmarks/cpu_collectives.py). Otherwise, on gloo, the flat all-gather and
reduce-scatter are issued as one broadcast / one reduce per rank of the group, in place on the rank's
slice. Gloo's own flat collectives stage through temporaries: at 135 MB and 2 ranks its all-gather took
0.11 s against 0.035 s for the broadcasts and its reduce-scatter 0.20 s against 0.15 s for the reduces,
with the same bytes per rank on the wire; below ~1M elements the two are within noise.
Counting and logging still see one all-gather or reduce-scatter.
"""

from __future__ import annotations

import datetime
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from .pending import AllOf, CollectiveError, CollectiveTimeout, Pending
from .progress import ProgressBoard, describe_laggards, Laggard
from .shm import ShmChannel, supported as shm_supports
from .topology import Group

__all__ = ["Collectives", "CollectiveError", "CollectiveTimeout", "CommStats", "Pending"]


# torch 2.13 renamed the flat-tensor collectives; older releases (>= 2.5) only have the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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


def _own_chunk(part: torch.Tensor, flat: torch.Tensor, group: Group) -> bool:
    """Whether `part` is this rank's chunk of `flat` (the collective then works in place)."""
    return part.data_ptr() == flat.data_ptr() + group.rank * part.nbytes


class Collectives:
    """Issues collectives on a `Group`, counting them in `stats` and bounding waits by `timeout_s`.

    A collective still pending after `warn_after_s` (0: never) logs once which ranks have not arrived, and
    one pending after `timeout_s` raises `CollectiveTimeout` naming them ([Note: waiting for a collective]).
    CPU tensors on a gloo group whose ranks share a host go through shared memory (`shm.py`);
    `shm=False`, or the environment variable SHARDWISE_SHM_COLLECTIVES=0, keeps gloo.
    `per_rank_on_gloo=False` keeps gloo's own flat all-gather and reduce-scatter (for comparison)."""

    def __init__(self, timeout_s: float = 1800.0, stats: CommStats | None = None, per_rank_on_gloo: bool = True,
                 shm: bool | None = None, warn_after_s: float = 60.0):
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.warn_after_s = warn_after_s
        self.stats = stats if stats is not None else CommStats()
        self.per_rank_on_gloo = per_rank_on_gloo
        self.use_shm = os.environ.get("SHARDWISE_SHM_COLLECTIVES", "1") != "0" if shm is None else shm
        self._global_ranks: dict[dist.ProcessGroup, list[int] | None] = {}
        self._channels: dict[dist.ProcessGroup, ShmChannel | None] = {}
        self._calls: dict[str, int] = {}
        """Collectives issued per group name: the "call #" of messages, the same on every rank of a group."""
        first_look = min(warn_after_s or timeout_s, timeout_s)
        self.progress = ProgressBoard(interval_s=min(max(first_look / 4, 0.05), 5.0))

    def _channel(self, group: Group, *tensors: torch.Tensor) -> ShmChannel | None:
        """The group's shared-memory channel when it serves these tensors, opening it on first use (a
        collective over the group, at the same point on every rank since collectives are issued in order)."""
        if not self.use_shm or group.size == 1 or any(t.device.type != "cpu" for t in tensors):
            return None
        if group.pg not in self._channels:
            gloo = dist.get_backend(group.pg) == "gloo"
            self._channels[group.pg] = ShmChannel.open(group.pg, self.timeout.total_seconds()) if gloo else None
        return self._channels[group.pg]

    def _per_rank(self, group: Group) -> list[int] | None:
        """The group's global ranks when its flat collectives go out per rank (a gloo group), else None."""
        if group.pg not in self._global_ranks:
            split = self.per_rank_on_gloo and dist.get_backend(group.pg) == "gloo"
            self._global_ranks[group.pg] = dist.get_process_group_ranks(group.pg) if split else None
        return self._global_ranks[group.pg]

    def _issue(self, op: str, group: Group, tensor: torch.Tensor, launch: Callable[[int], object],
               channel: ShmChannel | None = None) -> Pending:
        """Count, number and launch one collective; `launch(call)` starts it (on `channel` if given)."""
        completed = self.stats.record(op, group.name, tensor, group.size)
        call = self._calls[group.name] = self._calls.get(group.name, 0) + 1
        if group.size == 1:  # nothing to wait for, so nothing to describe (small models pay this per call)
            return Pending(None, "", self.timeout, completed)
        describe = (
            f"[rank {dist.get_rank()}/{dist.get_world_size()}, {group.name} group] {op} of "
            f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')} (call #{call})"
        )
        self.progress.note(group.name, call, op)
        diagnose = lambda final: self._who_is_missing(group, call, op, channel, final)  # noqa: E731 - slow path only
        try:
            work = launch(call)
        except RuntimeError as e:
            raise CollectiveError(f"{describe} failed: {e}; {diagnose(True)}") from e
        return Pending(work, describe, self.timeout, completed, self.warn_after_s, diagnose)

    def _who_is_missing(self, group: Group, call: int, op: str, channel: ShmChannel | None, final: bool) -> str:
        """Which ranks of `group` have not reached collective `call` (the slow path of a wait)."""
        ranks = dist.get_process_group_ranks(group.pg)
        if channel is None:
            return describe_laggards(*self.progress.laggards(group.name, ranks, call, op), final)
        return describe_laggards([Laggard(ranks[k], last_call, last_op, "exited" if exited else "")
                                  for k, last_call, last_op, exited in channel.laggards()], [], final)

    def _alone(self, op: str, group: Group, output: torch.Tensor, source: torch.Tensor) -> Pending:
        """A flat all-gather or reduce-scatter on a group of one: `output` becomes `source`, with no copy when they
        are one tensor (a ZeRO rank alone: its chunk is the whole buffer)."""
        if output.data_ptr() != source.data_ptr() or output.shape != source.shape:
            output.copy_(source)
        return self._issue(op, group, output if op == "all_gather" else source, lambda _: None)

    def all_reduce(self, tensor: torch.Tensor, group: Group, op: dist.ReduceOp = dist.ReduceOp.SUM) -> Pending:
        channel = self._channel(group, tensor) if shm_supports(op) else None
        if channel is not None:
            return self._issue("all_reduce", group, tensor, lambda call: channel.all_reduce(tensor, op, call), channel)
        return self._issue("all_reduce", group, tensor,
                           lambda _: dist.all_reduce(tensor, op=op, group=group.pg, async_op=True))

    def reduce_scatter(self, output: torch.Tensor, input_flat: torch.Tensor, group: Group) -> Pending:
        """Sum `input_flat` (group.size equal chunks) across ranks; this rank's chunk lands in `output`,
        which may be that chunk itself. `input_flat` is scratch afterwards: its contents are unspecified."""
        if group.size == 1:
            return self._alone("reduce_scatter", group, output, input_flat)
        channel = self._channel(group, output, input_flat)
        if channel is not None:
            return self._issue("reduce_scatter", group, input_flat,
                               lambda call: channel.reduce_scatter(output, input_flat, call), channel)
        ranks = self._per_rank(group) if group.size > 1 else None
        if ranks is None:
            if input_flat.device.type == "cpu" and _own_chunk(output, input_flat, group):
                input_flat = input_flat.clone()  # gloo's own reduce-scatter does not work in place
            return self._issue("reduce_scatter", group, input_flat,
                               lambda _: _reduce_scatter(output, input_flat, group=group.pg, async_op=True))
        chunks = input_flat.view(group.size, -1).unbind(0)

        def per_rank(_: int) -> AllOf:
            works = [dist.reduce(chunk, dst=r, group=group.pg, async_op=True) for chunk, r in zip(chunks, ranks)]
            mine = chunks[group.rank]
            return AllOf(works, None if _own_chunk(output, input_flat, group) else lambda: output.copy_(mine))

        return self._issue("reduce_scatter", group, input_flat, per_rank)

    def all_gather(self, output_flat: torch.Tensor, shard: torch.Tensor, group: Group) -> Pending:
        """Concatenate every rank's `shard` into `output_flat`; `shard` may be this rank's slice of it."""
        if group.size == 1:
            return self._alone("all_gather", group, output_flat, shard)
        channel = self._channel(group, output_flat, shard)
        if channel is not None:
            return self._issue("all_gather", group, output_flat,
                               lambda call: channel.all_gather(output_flat, shard, call), channel)
        ranks = self._per_rank(group) if group.size > 1 else None
        if ranks is None:
            if shard.device.type == "cpu" and _own_chunk(shard, output_flat, group):
                shard = shard.clone()  # gloo copies the input into the output: not in place
            return self._issue("all_gather", group, output_flat,
                               lambda _: _all_gather(output_flat, shard, group=group.pg, async_op=True))
        chunks = output_flat.view(group.size, -1).unbind(0)

        def per_rank(_: int) -> AllOf:
            if not _own_chunk(shard, output_flat, group):
                chunks[group.rank].copy_(shard)
            return AllOf([dist.broadcast(chunk, src=r, group=group.pg, async_op=True) for chunk, r in zip(chunks, ranks)])

        return self._issue("all_gather", group, output_flat, per_rank)

    def streams_coalesced(self, group: Group, device: torch.device) -> bool:
        """Whether coalesced collectives on `group` of tensors on `device` may travel as one stream (shared memory),
        rather than one by one ([Note: coalesced collectives])."""
        return self.use_shm and group.size > 1 and device.type == "cpu"

    def all_gather_coalesced(self, outputs: list[torch.Tensor], shards: list[torch.Tensor], group: Group) -> list[Pending]:
        """`all_gather(outputs[i], shards[i], group)` for each i, in order, one pending each ([Note: coalesced
        collectives])."""
        return self._coalesced("all_gather", outputs, shards, group, self.all_gather, ShmChannel.all_gather_many)

    def reduce_scatter_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], group: Group) -> list[Pending]:
        """`reduce_scatter(outputs[i], inputs[i], group)` for each i, in order, one pending each ([Note: coalesced
        collectives])."""
        return self._coalesced("reduce_scatter", inputs, outputs, group, lambda o, i, g: self.reduce_scatter(i, o, g),
                               lambda channel, i, o, calls: ShmChannel.reduce_scatter_many(channel, o, i, calls))

    def _coalesced(self, op: str, counted: list[torch.Tensor], others: list[torch.Tensor], group: Group,
                   one: Callable[[torch.Tensor, torch.Tensor, Group], Pending],
                   many: Callable[[ShmChannel, list[torch.Tensor], list[torch.Tensor], list[int]], list]) -> list[Pending]:
        """[Note: coalesced collectives] Several all-gathers or reduce-scatters issued together are counted and
        numbered as that many collectives, each with its own pending. On a shared-memory channel, if they share a
        dtype, they travel as one stream of pieces (`ShmChannel.all_gather_many`, `reduce_scatter_many`): small
        ones share synchronisations, and each completes as soon as its own part has. Elsewhere they are issued one
        by one. `counted` are the tensors the statistics count (the gathers' outputs, the reductions' inputs)."""
        channel = self._channel(group, *counted, *others) if len(counted) > 1 else None
        if channel is None or len({t.dtype for t in (*counted, *others)}) > 1:
            return [one(c, o, group) for c, o in zip(counted, others)]
        stream: list = []

        def launch(call: int, i: int) -> object:
            if not stream:  # the first of them: the collectives numbered call, call + 1, ... are these
                stream.extend(many(channel, counted, others, list(range(call, call + len(counted)))))
            return stream[i]

        return [self._issue(op, group, tensor, lambda call, i=i: launch(call, i), channel) for i, tensor in enumerate(counted)]

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, group: Group) -> Pending:
        """Exchange chunks: `input` (flat) is group.size equal chunks, chunk r going to rank r of the group;
        `output` (flat, the same size, not overlapping `input`) receives chunk `group.rank` of every rank, in
        rank order. Counted with the bytes of `input`. Always gloo's or NCCL's own all-to-all (no shared-memory
        path: its one user, the quantized gradient reduce-scatter, sends a fraction of the fp32 bytes); gloo
        exchanges CPU tensors of any dtype, uint8 included (checked on torch 2.13)."""
        if input.numel() % group.size or output.numel() != input.numel():
            raise ValueError(f"all_to_all: input and output of the same size, a multiple of the {group.name} "
                             f"group's {group.size} ranks, are required; got {input.numel()} and {output.numel()}.")
        if group.size == 1:
            output.copy_(input)
        return self._issue("all_to_all", group, input,
                           lambda _: dist.all_to_all_single(output, input, group=group.pg, async_op=True))

    def send(self, tensor: torch.Tensor, peer: int, group: Group, tag: int = 0) -> Pending:
        """Post `tensor` to global rank `peer` of `group` (point to point: pipeline activations and gradients)."""
        return self._point_to_point("send", tensor, peer, group, tag, dist.isend)

    def recv(self, tensor: torch.Tensor, peer: int, group: Group, tag: int = 0) -> Pending:
        """Receive into `tensor` what global rank `peer` of `group` sends with the same `tag`."""
        return self._point_to_point("recv", tensor, peer, group, tag, dist.irecv)

    def _point_to_point(self, op: str, tensor: torch.Tensor, peer: int, group: Group, tag: int,
                        post: Callable[..., dist.Work]) -> Pending:
        """Counted and bounded like a collective; a stuck one names the peer it waits on. NCCL ignores tags:
        its sends and receives between two ranks match in the order they are posted, as the schedules post them."""
        completed = self.stats.record(op, group.name, tensor, group.size)
        describe = (f"[rank {dist.get_rank()}/{dist.get_world_size()}, {group.name} group] {op} of "
                    f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')} "
                    f"{'to' if op == 'send' else 'from'} rank {peer} (tag {tag})")
        gloo = dist.get_backend(group.pg) == "gloo"
        try:
            work = post(tensor, peer, group=group.pg, tag=tag if gloo else 0)
        except RuntimeError as e:
            raise CollectiveError(f"{describe} failed: {e}") from e
        peer_state = lambda final: f"rank {peer} has not {'received it' if op == 'send' else 'sent it'}"  # noqa: E731
        return Pending(work, describe, self.timeout, completed, self.warn_after_s, peer_state)

    def broadcast(self, tensor: torch.Tensor, src_rank_in_group: int, group: Group) -> Pending:
        channel = self._channel(group, tensor)
        if channel is not None:
            return self._issue("broadcast", group, tensor,
                               lambda call: channel.broadcast(tensor, src_rank_in_group, call), channel)
        src = dist.get_global_rank(group.pg, src_rank_in_group)
        return self._issue("broadcast", group, tensor,
                           lambda _: dist.broadcast(tensor, src=src, group=group.pg, async_op=True))
