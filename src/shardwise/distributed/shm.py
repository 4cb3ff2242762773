"""Collectives between the ranks of one host through shared memory, for CPU tensors on gloo groups.

Why: gloo moves CPU tensors over TCP loopback, so every byte is copied into the kernel and out again and
every reduction is staged. On the 2-core CI machine that CPU work competes with the ranks' own compute:
a 25 MiB all-reduce costs 13.5 ms of CPU through gloo and 4.5 ms here, a reduce-scatter 20-33 ms
against 7 ms, an all-gather 8-13 ms against 3 ms (`benchmarks/cpu_collectives.py`). DeepSpeed's CPU
backend has a shared-memory all-reduce for the same reason.

How: each rank owns one file in /dev/shm that every rank of the group maps: a header holding the rank's
sequence counter (and the number and op of the collective it last started, which its peers name when it
never arrives: `laggards`), then two regions. A collective runs in pieces no larger than a region; for each piece a
rank writes its contribution into its region, publishes the piece's sequence number, waits until every
peer has published it, and reads what it needs from the peers' regions. Pieces alternate between the two
regions, so a rank writes a region again only once every peer has published the next piece, which it does
after it finished reading that region: one synchronisation per piece. Reductions are summed in rank order,
so an all-reduce gives every rank the same bits.

The collectives of a channel run on one worker thread, in the order they were issued (the same on every
rank); `Collectives` hands out their completion as it does gloo's work objects. The files are unlinked as
soon as every rank has mapped them, so a crash leaves nothing in /dev/shm. The channel is opened by one
collective exchange over the group's gloo process group and used only if every rank could create its file
and read every peer's (same host, same /dev/shm), otherwise every rank keeps gloo.

[Note: waiting without polling] A worker whose peer has not yet published a piece sleeps on the peer's
counter (a futex on the shared word: the peer's publish wakes it), never in a polling loop. The ranks' compute
keeps every core busy during backward, so each wake-up of a waiting worker preempts a compute thread and evicts
its cache: the ZeRO-3 step of the 33.7M-parameter bench GPT at world 2 on two cores saw ~2000 preemptions of its
main thread per step while the workers polled (sleeps of 20 us doubling to 1 ms), ~750 with the futex.

Memory order: a rank publishes its counter after writing its region, and a peer reads the region after
reading the counter. x86-64 keeps stores in order and loads in order, which is all this needs; other
architectures do not guarantee it without fences Python cannot issue, so the channel is x86-64 only.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import mmap
import os
import platform
import queue
import struct
import threading
import time
import uuid
import weakref
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from .progress import alive, pid_namespace

SHM_DIR = "/dev/shm"
REGION_BYTES = 2**20
"""Bytes per region (two per rank). Every rank maps every region, and those it touches count in its RSS
(4 MiB per rank at world size 2). Larger regions would mean fewer synchronisations (about 0.1 ms each),
but 1 MiB was as fast as 2 MiB, and as fast as or faster than 4 MiB, at every size of
`benchmarks/cpu_collectives.py`: regions this small stay in cache between the writer and the readers."""
_HEADER = 4096  # sequence counter (int64) at 0, the rank's token (32 ASCII bytes) at 8, its collective at 40
LIVENESS_CHECK_S = 1.0
"""A worker waiting for a peer checks this often whether the peer's process still exists."""
WAITER_FIRST_S = 1.0
"""The worker gives up this long after the timeout, so that the thread waiting for the collective (which
names the ranks that never arrived) times out first; the worker's own limit is for collectives nobody waits for."""
_CALL_AT = 40
"""The number and op of the collective the rank's worker last started (two int64): what its peers report
when it never arrives (`laggards`)."""
_OPS = ("", "all_reduce", "reduce_scatter", "all_gather", "broadcast")
_REDUCE = {
    dist.ReduceOp.SUM: torch.add,
    dist.ReduceOp.MAX: torch.maximum,
    dist.ReduceOp.MIN: torch.minimum,
    dist.ReduceOp.PRODUCT: torch.mul,
}


def supported(op: dist.ReduceOp = dist.ReduceOp.SUM) -> bool:
    return op in _REDUCE


class ShmWork:
    """One collective queued on a channel; duck-types `dist.Work` for `collectives.Pending`."""

    def __init__(self, run: Callable[[], None]):
        self.run = run
        self.error: BaseException | None = None
        self._done = threading.Event()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout) -> bool:
        if not self._done.wait(timeout.total_seconds()):
            return False
        if self.error is not None:
            raise RuntimeError(str(self.error)) from self.error
        return True

    def finish(self, error: BaseException | None) -> None:
        self.error, self.run = error, None  # the closure holds the tensors and the channel: let them go
        self._done.set()


def _release_and_finish(work: ShmWork, i: int, *held: list) -> None:
    """Complete collective `i` of a stream, first dropping the stream's references to its tensors. The stream runs on
    after `i` completes: holding them, it would keep a buffer alive that the waiter has let go of once `wait()`
    returns (a ZeRO-1 step's flat gradient, measured by the planner's peak check), as a single collective never does
    (`ShmWork.finish`)."""
    for tensors in held:
        tensors[i] = None
    work.finish(None)


class ShmChannel:
    """Shared-memory collectives over one group of same-host ranks (see the module docstring)."""

    def __init__(self, maps: list[mmap.mmap], rank: int, region_bytes: int, timeout_s: float, pids: list[int | None]):
        self.maps, self.rank, self.size = maps, rank, len(maps)
        self.region_bytes, self.timeout_s, self.pids = region_bytes, timeout_s, pids
        self._seq = 0
        self._regions: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
        self._broken: str | None = None
        # Each rank's sequence counter, as an address to sleep on (the low half of the little-endian int64).
        self._words = [ctypes.c_char.from_buffer(m) for m in maps]
        self._counter_at = [ctypes.addressof(w) for w in self._words]
        # The worker holds only the queue, so a channel nobody uses any more is collected, and its worker
        # and mappings go with it (engines built one after another in a process would pile them up).
        self._queue: queue.SimpleQueue[ShmWork | None] = queue.SimpleQueue()
        threading.Thread(target=_serve, args=(self._queue,), name=f"shardwise-shm-rank{rank}", daemon=True).start()
        weakref.finalize(self, self._queue.put, None)

    @classmethod
    def open(cls, pg: dist.ProcessGroup, timeout_s: float, region_bytes: int | None = None,
             directory: str | None = None) -> ShmChannel | None:
        """Collective over `pg` (every rank calls it at the same point): a channel, or None on every rank
        if any rank cannot share memory with all the others."""
        rank, size = dist.get_rank(pg), dist.get_world_size(pg)
        region_bytes, directory = region_bytes or REGION_BYTES, directory or SHM_DIR
        token = uuid.uuid4().hex
        path = os.path.join(directory, f"shardwise-{token}")
        mine = _create(path, token, _HEADER + 2 * region_bytes) if platform.machine() in ("x86_64", "AMD64") else None
        offers: list = [None] * size
        dist.all_gather_object(offers, (path if mine else None, token, (os.getpid(), pid_namespace())), group=pg)
        maps: list[mmap.mmap] | None = None
        if all(p is not None for p, _, _ in offers):
            maps = [mine if k == rank else _attach(p, t, _HEADER + 2 * region_bytes) for k, (p, t, _) in enumerate(offers)]
        ok = [None] * size
        dist.all_gather_object(ok, maps is not None and all(m is not None for m in maps), group=pg)
        if mine is not None:
            os.unlink(path)  # every rank has mapped it (or given up): the mappings outlive the name
        if not all(ok):
            for m in maps or [mine]:
                if m is not None:
                    m.close()
            return None
        same_pids = len({ns for _, _, (_, ns) in offers}) == 1  # else a peer's pid means nothing here
        return cls(maps, rank, region_bytes, timeout_s, [pid if same_pids else None for _, _, (pid, _) in offers])

    def _submit(self, run: Callable[[], None], op: str, call: int, parts: list[ShmWork] = ()) -> ShmWork:
        """Queue a collective (number `call` of the group, for error messages) on the worker; it runs after
        those queued before. `parts`: works that `run` completes itself (`all_gather_many`); those it has not
        completed when it fails get its error."""

        def guarded() -> None:
            try:
                if self._broken is not None:  # the ranks' sequence numbers no longer agree
                    raise RuntimeError(f"an earlier shared-memory collective of this group failed: {self._broken}")
                struct.pack_into("<qq", self.maps[self.rank], _CALL_AT, call, _OPS.index(op))
                run()
            except BaseException as e:
                self._broken = self._broken or str(e)
                for part in parts:
                    if not part.is_completed():
                        part.finish(e)
                raise

        work = ShmWork(guarded)
        self._queue.put(work)
        return work

    # The collectives, queued on the worker: each is a sequence of pieces that every rank runs in the same order.

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp, call: int = 0) -> ShmWork:
        combine = _REDUCE[op]

        def run() -> None:
            flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
            for lo, hi in self._pieces(flat.numel(), flat.element_size(), 1):
                slot = self._seq % 2
                self._region(self.rank, slot, flat.dtype)[: hi - lo].copy_(flat[lo:hi])
                self._publish_and_wait()
                # Every rank combines the regions in rank order, its own included: identical bits everywhere.
                regions = [self._region(k, slot, flat.dtype)[: hi - lo] for k in range(self.size)]
                combine(regions[0], regions[1], out=flat[lo:hi])
                for region in regions[2:]:
                    combine(flat[lo:hi], region, out=flat[lo:hi])
            if flat.data_ptr() != tensor.data_ptr():
                tensor.copy_(flat.view_as(tensor))

        return self._submit(run, "all_reduce", call)

    def reduce_scatter(self, output: torch.Tensor, input_flat: torch.Tensor, call: int = 0) -> ShmWork:
        return self.reduce_scatter_many([output], [input_flat], [call])[0]

    def reduce_scatter_many(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], calls: list[int]) -> list[ShmWork]:
        """Several reduce-scatters (collectives `calls`, of one dtype) as one stream of pieces, as
        `all_gather_many` streams gathers: each completes as soon as its own output is reduced."""
        parts = [ShmWork(None) for _ in outputs]
        # The stream's own references, dropped as each collective completes (`_release_and_finish`).
        chunks: list = [flat.view(self.size, -1) for flat in inputs]
        outputs = list(outputs)
        dtype, itemsize, widths = inputs[0].dtype, inputs[0].element_size(), [c.shape[1] for c in chunks]

        def part(writer: int, reader: int) -> int:
            # A rank's region holds its contribution to each peer's chunk, not to its own (it adds that in place):
            # size - 1 parts, so at world size 2 a piece fills the whole region and a reduce-scatter takes half the
            # synchronisations it would with a part per rank.
            return reader if reader < writer else reader - 1

        def done(i: int) -> None:
            _release_and_finish(parts[i], i, chunks, outputs)

        def reduce(slot: int, step: int, i: int, a: int, b: int, at: int) -> None:
            # A function of its own so that no view of a finished collective's tensors outlives the piece.
            out, own = outputs[i][a:b], chunks[i][self.rank][a:b]  # `out` may be `own`: read first, in place
            if out.data_ptr() != own.data_ptr():
                out.copy_(own)
            for k in range(self.size):
                if k != self.rank:
                    base = part(k, self.rank) * step + at
                    out.add_(self._region(k, slot, dtype)[base : base + b - a])

        def run() -> None:
            for slot, segments in self._stream(widths, itemsize, self.size - 1, "reduce_scatter", calls, done):
                region = self._region(self.rank, slot, dtype)
                step = region.numel() // (self.size - 1)
                for i, a, b, at in segments:
                    for k in range(self.size):
                        if k != self.rank:
                            base = part(self.rank, k) * step + at
                            region[base : base + b - a].copy_(chunks[i][k][a:b])
                self._publish_and_wait()
                for segment in segments:
                    reduce(slot, step, *segment)

        self._submit(run, "reduce_scatter", calls[0], parts)
        return parts

    def all_gather(self, output_flat: torch.Tensor, shard: torch.Tensor, call: int = 0) -> ShmWork:
        return self.all_gather_many([output_flat], [shard], [call])[0]

    def all_gather_many(self, outputs: list[torch.Tensor], shards: list[torch.Tensor], calls: list[int]) -> list[ShmWork]:
        """Several all-gathers (collectives `calls`, of one dtype) as one stream of pieces: the end of one shard and
        the start of the next share a piece, so small gathers issued together take fewer synchronisations than
        one each. Each gather's work completes as soon as its own output is whole, not at the end of the stream."""
        parts = [ShmWork(None) for _ in outputs]
        outputs, shards = list(outputs), list(shards)  # the stream's own references (`_release_and_finish`)
        dtype, itemsize, widths = shards[0].dtype, shards[0].element_size(), [s.numel() for s in shards]

        def finish_own(i: int) -> None:
            own = outputs[i].view(self.size, -1)[self.rank]
            if own.data_ptr() != shards[i].data_ptr():
                own.copy_(shards[i])
            del own  # a view: it would hold the output past its completion
            _release_and_finish(parts[i], i, outputs, shards)

        def run() -> None:
            for slot, segments in self._stream(widths, itemsize, 1, "all_gather", calls, finish_own):
                mine = self._region(self.rank, slot, dtype)
                for i, a, b, at in segments:
                    mine[at : at + b - a].copy_(shards[i][a:b])
                self._publish_and_wait()
                for k in range(self.size):
                    if k != self.rank:
                        theirs = self._region(k, slot, dtype)
                        for i, a, b, at in segments:
                            outputs[i].view(self.size, -1)[k][a:b].copy_(theirs[at : at + b - a])

        self._submit(run, "all_gather", calls[0], parts)
        return parts

    def _stream(self, widths: list[int], itemsize: int, ways: int, op: str, calls: list[int],
                finish: Callable[[int], None]) -> Iterator[tuple[int, list[tuple[int, int, int, int]]]]:
        """Walk collectives of `widths` elements each (per part of a region), laid end to end, in pieces of a region
        split `ways` ways. Yields each piece's slot and its segments (i, a, b, at): elements [a, b) of collective i
        lie at `at` in the piece. A collective's number is written to the header as it starts; once the caller has
        handled a piece, `finish(i)` runs, in order, for each collective that ended in it."""
        ends = list(itertools.accumulate(widths))
        starts = [end - width for end, width in zip(ends, widths)]
        done = 0  # the collectives before `done` are complete
        for lo, hi in self._pieces(ends[-1], itemsize, ways):
            segments, i = [], done
            while i < len(widths) and starts[i] < hi:
                a = max(lo, starts[i])
                segments.append((i, a - starts[i], min(hi, ends[i]) - starts[i], a - lo))
                if a == starts[i]:
                    struct.pack_into("<qq", self.maps[self.rank], _CALL_AT, calls[i], _OPS.index(op))
                i += 1
            yield self._seq % 2, segments
            while done < len(widths) and ends[done] <= hi:
                finish(done)
                done += 1

    def broadcast(self, tensor: torch.Tensor, src: int, call: int = 0) -> ShmWork:
        def run() -> None:
            flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
            for lo, hi in self._pieces(flat.numel(), flat.element_size(), 1):
                slot = self._seq % 2
                if self.rank == src:
                    self._region(self.rank, slot, flat.dtype)[: hi - lo].copy_(flat[lo:hi])
                self._publish_and_wait()
                if self.rank != src:
                    flat[lo:hi].copy_(self._region(src, slot, flat.dtype)[: hi - lo])
            if self.rank != src and flat.data_ptr() != tensor.data_ptr():
                tensor.copy_(flat.view_as(tensor))

        return self._submit(run, "broadcast", call)

    def laggards(self) -> list[tuple[int, int, str, bool]]:
        """The group ranks that have not published the piece this rank's worker is at (or last ran), each with
        the number and op of the collective it last started and whether it has exited."""
        behind = []
        for k in range(self.size):
            if struct.unpack_from("<q", self.maps[k], 0)[0] < self._seq:
                call, op = struct.unpack_from("<qq", self.maps[k], _CALL_AT)
                behind.append((k, call, _OPS[op] if 0 <= op < len(_OPS) else "?", not alive(self.pids[k])))
        return behind

    # Pieces, regions and the synchronisation.

    def _pieces(self, numel: int, itemsize: int, ways: int) -> list[tuple[int, int]]:
        """[lo, hi) ranges of at most a region's worth (split `ways` ways); an empty tensor is one empty piece,
        so every rank still takes part in the same synchronisations."""
        step = max(1, self.region_bytes // (itemsize * ways))
        return [(lo, min(lo + step, numel)) for lo in range(0, numel, step)] or [(0, 0)]

    def _region(self, rank: int, slot: int, dtype: torch.dtype) -> torch.Tensor:
        key = (rank, slot, dtype)
        if key not in self._regions:
            self._regions[key] = torch.frombuffer(self.maps[rank], dtype=dtype, count=self.region_bytes // dtype.itemsize,
                                                  offset=_HEADER + slot * self.region_bytes)
        return self._regions[key]

    def _publish_and_wait(self) -> None:
        self._seq += 1
        struct.pack_into("<q", self.maps[self.rank], 0, self._seq)
        _futex_wake(self._counter_at[self.rank])
        deadline = time.monotonic() + self.timeout_s + WAITER_FIRST_S
        for k in range(self.size):
            while (seen := struct.unpack_from("<q", self.maps[k], 0)[0]) < self._seq:
                # Sleep until rank k publishes (it wakes us) rather than poll: on a machine whose cores the ranks'
                # compute keeps busy, every wake-up of a polling worker preempted a compute thread
                # ([Note: waiting without polling]).
                now = time.monotonic()
                if now > deadline:
                    raise RuntimeError(f"timed out after {self.timeout_s:g} s waiting for rank {k} of the group "
                                       f"in a shared-memory collective")
                if not _futex_wait(self._counter_at[k], seen, min(LIVENESS_CHECK_S, deadline - now)):
                    if not alive(self.pids[k]):
                        raise RuntimeError(f"rank {k} of the group (pid {self.pids[k]}) exited during a shared-memory collective")


_SYS_FUTEX = 202  # x86-64 Linux, the only platform the channel opens on
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # not the _PRIVATE variants: the word is shared between processes
_libc = ctypes.CDLL(None, use_errno=True)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _futex_wait(address: int, seen: int, seconds: float) -> bool:
    """Sleep while the 32-bit word at `address` (a sequence counter's low half) still holds `seen`'s low half,
    at most `seconds`; False when the time ran out, True otherwise (woken, changed meanwhile, or interrupted:
    the caller rereads the counter in every case)."""
    seconds = max(seconds, 0.0)
    timeout = _Timespec(int(seconds), int((seconds % 1) * 1e9))
    expected = ctypes.c_int32(seen & 0xFFFFFFFF).value
    if _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT, expected, ctypes.byref(timeout), None, 0) == 0:
        return True
    return ctypes.get_errno() != errno.ETIMEDOUT


def _futex_wake(address: int) -> None:
    """Wake every thread (of any process) sleeping on the word at `address`."""
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, 2**31 - 1, None, None, 0)


def _serve(works: queue.SimpleQueue) -> None:
    while (work := works.get()) is not None:
        try:
            work.run()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            work.finish(e)
        else:
            work.finish(None)
        del work  # its closure holds the channel


def _create(path: str, token: str, nbytes: int) -> mmap.mmap | None:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, nbytes)  # fails now, not with SIGBUS later, when /dev/shm is too small
        m = mmap.mmap(fd, nbytes)
    except OSError:
        os.close(fd)
        os.unlink(path)
        return None
    os.close(fd)
    m[8:40] = token.encode()
    return m


def _attach(path: str, token: str, nbytes: int) -> mmap.mmap | None:
    """Map a peer's file, if it is reachable here and is the peer's (it holds the token the peer sent)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        m = mmap.mmap(fd, nbytes)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    if m[8:40] != token.encode():
        m.close()
        return None
    return m
