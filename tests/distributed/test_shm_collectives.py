"""Shared-memory collectives (`distributed/shm.py`) against gloo's, and how they fail."""

from __future__ import annotations

import datetime
import gc
import subprocess
import sys
import threading
import time
import weakref

import pytest
import torch
import torch.distributed as dist

from shardwise.distributed import Collectives, CollectiveError, CollectiveTimeout
from shardwise.distributed import shm
from shardwise.distributed.topology import Group
from tests.harness import run_distributed

# A region of 1 KiB splits every collective below into many uneven pieces.
SMALL_REGION = 1024


def _setup(region_bytes: int) -> tuple[Group, Collectives, Collectives]:
    dist.init_process_group("gloo")
    shm.REGION_BYTES = region_bytes
    group = Group("data", dist.group.WORLD, dist.get_world_size(), dist.get_rank())
    return group, Collectives(shm=True), Collectives(shm=False)


def _compare_with_gloo(region_bytes: int, chunk: int) -> list[torch.Tensor]:
    group, ours, gloo = _setup(region_bytes)
    rank, world = group.rank, group.size
    torch.manual_seed(rank)
    reduced = []
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        x = (torch.randn(world * chunk) * 100).to(dtype)
        # Gloo sums in another order: the same sum up to rounding (exact for integers).
        close = {torch.float32: dict(rtol=1e-5, atol=1e-3), torch.bfloat16: dict(rtol=1e-2, atol=2.0)}.get(dtype, {})
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN):
            a, b = x.clone(), x.clone()
            ours.all_reduce(a, group, op).wait()
            gloo.all_reduce(b, group, op).wait()
            torch.testing.assert_close(a, b, **close)
            reduced.append(a)
        strided = x.clone().view(chunk, world).t()  # not contiguous: reduced through a copy, written back
        expected = strided.clone()
        ours.all_reduce(strided, group).wait()
        gloo.all_reduce(expected, group).wait()
        torch.testing.assert_close(strided, expected, **close)

        expected = torch.empty(chunk, dtype=dtype)
        gloo.reduce_scatter(expected, x.clone(), group).wait()
        out = torch.empty(chunk, dtype=dtype)
        ours.reduce_scatter(out, x.clone(), group).wait()
        torch.testing.assert_close(out, expected, **close)
        in_place = x.clone()
        ours.reduce_scatter(in_place.view(world, -1)[rank], in_place, group).wait()
        torch.testing.assert_close(in_place.view(world, -1)[rank], expected, **close)

        shard = x[:chunk].clone()
        expected = torch.empty(world * chunk, dtype=dtype)
        gloo.all_gather(expected, shard, group).wait()
        gathered = torch.empty(world * chunk, dtype=dtype)
        ours.all_gather(gathered, shard, group).wait()
        assert torch.equal(gathered, expected)
        own = torch.zeros(world * chunk, dtype=dtype)
        own.view(world, -1)[rank] = shard
        ours.all_gather(own, own.view(world, -1)[rank], group).wait()
        assert torch.equal(own, expected)

        sent = x.clone()
        ours.broadcast(sent, world - 1, group).wait()
        expected = x.clone()
        gloo.broadcast(expected, world - 1, group).wait()
        assert torch.equal(sent, expected)
    ours.all_reduce(torch.empty(0), group).wait()  # every rank takes part, nothing moves

    assert ours._channels[group.pg] is not None, "the shared-memory channel did not open"
    assert ours.stats.calls("all_reduce") == 13 and ours.stats.calls("reduce_scatter") == 6
    assert ours.stats.elements("all_gather") == 6 * world * chunk
    return reduced


@pytest.mark.parametrize("world,region_bytes,chunk", [(2, SMALL_REGION, 1001), (3, SMALL_REGION, 333), (4, 4 * 2**20, 5000)])
def test_shm_collectives_equal_gloo(world, region_bytes, chunk):
    results = run_distributed(_compare_with_gloo, world, region_bytes, chunk)
    for other in results[1:]:  # all-reduce sums in rank order everywhere: the same bits on every rank
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def _synchronisations_per_reduce_scatter() -> list[int]:
    group, ours, _ = _setup(SMALL_REGION)
    world, floats = group.size, SMALL_REGION // 4
    channel = ours._channel(group, torch.empty(0))
    counts = []
    for per_peer in (floats // (world - 1), floats // (world - 1) + 1):
        x = torch.arange(world * per_peer, dtype=torch.float32) * (group.rank + 1)
        out = torch.empty(per_peer)
        before = channel._seq
        ours.reduce_scatter(out, x, group).wait()
        counts.append(channel._seq - before)
        expected = torch.arange(world * per_peer, dtype=torch.float32).view(world, -1)[group.rank] * sum(range(1, world + 1))
        assert torch.equal(out, expected)
    return counts


@pytest.mark.parametrize("world", [2, 3])
def test_a_reduce_scatter_fills_the_region_with_what_the_peers_need(world):
    # A rank sends nothing to itself: its region holds world - 1 parts, so a piece carries a full region's
    # worth and a reduce-scatter of a region per rank is one synchronisation, not `world` of them.
    assert run_distributed(_synchronisations_per_reduce_scatter, world) == [[1, 2]] * world


def _coalesced_gathers() -> tuple[int, int]:
    group, ours, gloo = _setup(SMALL_REGION)
    world, rank = group.size, group.rank
    floats = SMALL_REGION // 4
    # Shards smaller than a piece, one spanning several, an empty one and one ending on a piece's edge.
    sizes = [5, floats // 3, 0, 2 * floats + 7, 1, floats - 13, 3]
    shards = [torch.randn(n) + 10 * rank for n in sizes]
    expected = []
    for shard in shards:
        out = torch.empty(world * shard.numel())
        gloo.all_gather(out, shard, group).wait()
        expected.append(out)
    channel = ours._channel(group, torch.empty(0))
    outputs = [torch.full((world * n,), float("nan")) for n in sizes]
    in_place = outputs[3].view(world, -1)[rank]  # a unit's own slice may be its chunk of the output
    in_place.copy_(shards[3])
    sources = shards[:3] + [in_place] + shards[4:]
    before, calls = channel._seq, ours.stats.calls("all_gather")
    pending = ours.all_gather_coalesced(outputs, sources, group)
    pending[1].wait()  # whole before the stream ends
    assert torch.equal(outputs[1], expected[1])
    for p in pending:
        p.wait()
    for out, exp in zip(outputs, expected):
        assert torch.equal(out, exp)
    assert ours.stats.calls("all_gather") - calls == len(sizes)  # counted as the gathers they are
    coalesced = channel._seq - before
    before = channel._seq
    for out, shard in zip(outputs, shards):
        ours.all_gather(out, shard, group).wait()
    return coalesced, channel._seq - before


@pytest.mark.parametrize("world", [2, 3])
def test_coalesced_gathers_share_pieces_and_equal_separate_ones(world):
    # 3 * floats + 7 + small ones: four region-sized pieces together, nine pieces one by one.
    assert run_distributed(_coalesced_gathers, world) == [(4, 9)] * world


def _stream_lets_go_of_what_it_finished(op: str) -> bool:
    group, ours, _ = _setup(SMALL_REGION)
    floats, world = SMALL_REGION // 4, group.size
    channel = ours._channel(group, torch.empty(0))
    timeout = datetime.timedelta(seconds=30)

    def issue(widths: list[int]) -> tuple[list, list[torch.Tensor]]:
        """One stream of `op`s of `widths` elements per rank; its works and its whole-size tensors (the
        reduce-scatters' inputs, the gathers' outputs)."""
        whole = [torch.ones(world * w) for w in widths]
        calls = list(range(len(widths)))
        if op == "reduce_scatter":
            return channel.reduce_scatter_many([torch.empty(w) for w in widths], whole, calls), whole
        return channel.all_gather_many(whole, [torch.ones(w) for w in widths], calls), whole

    if group.rank == 0:
        # A small collective, done in the first of four pieces, then one spanning the other three: the stream's
        # worker waits at the second piece until rank 1 lets it go, after the check.
        works, whole = issue([16, 3 * floats])
        kept = weakref.ref(whole[0])
        works[0].wait(timeout)
        del whole
        released = kept() is None  # the caller let go of it: nothing else may hold it while the stream runs on
        dist.barrier()
        works[1].wait(timeout)
        return released
    [work], _ = issue([floats])  # rank 0's first piece
    work.wait(timeout)
    dist.barrier()
    [work], _ = issue([3 * floats])  # its other three
    work.wait(timeout)
    return True


@pytest.mark.parametrize("op", ["reduce_scatter", "all_gather"])
def test_a_stream_lets_go_of_a_finished_collectives_tensors_before_its_waiter_wakes(op):
    # The stream ran on holding a ZeRO-1 step's flat gradient after its reduce-scatter had completed: the planner's
    # peak check measured that buffer alive when the worker thread was slow to end (about one run in six, loaded).
    assert run_distributed(_stream_lets_go_of_what_it_finished, 2, op) == [True, True]


def _overlap() -> None:
    group, ours, _ = _setup(SMALL_REGION)
    flats = [torch.full((4096,), float(group.rank + k)) for k in range(8)]
    pending = [ours.all_reduce(f, group) for f in flats]  # queued; run in order on the channel's thread
    deadline = time.monotonic() + 20
    while not pending[-1].done():  # completes with nobody waiting, and says so without blocking
        assert time.monotonic() < deadline, "done() never turned true"
        time.sleep(0.001)
    for k, (p, f) in enumerate(zip(pending, flats)):
        p.wait()
        assert torch.equal(f, torch.full((4096,), float(2 * k + 1)))
    # Once nothing refers to the channel, its worker thread ends (engines built one after another must not
    # leave one behind each).
    del ours, pending, p
    gc.collect()
    while any(t.name.startswith("shardwise-shm") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the channel's worker thread outlived it"
        time.sleep(0.01)


def test_shm_collectives_run_asynchronously_in_issue_order():
    run_distributed(_overlap, 2)


def _no_shared_memory_anywhere_if_one_rank_lacks_it() -> bool:
    group, ours, _ = _setup(shm.REGION_BYTES)
    if group.rank == 1:
        shm.SHM_DIR = "/nonexistent-shardwise-test"
    x = torch.full((10,), float(group.rank))
    ours.all_reduce(x, group).wait()  # every rank falls back to gloo, together
    assert torch.equal(x, torch.full((10,), 1.0))
    return ours._channels[group.pg] is None


def test_every_rank_keeps_gloo_when_one_rank_cannot_share_memory():
    assert run_distributed(_no_shared_memory_anywhere_if_one_rank_lacks_it, 2) == [True, True]


def _peer_never_arrives(dead_pid: int) -> None:
    group, _, _ = _setup(SMALL_REGION)
    x = torch.ones(10)
    for case in ("timeout", "exited"):
        comm = Collectives(timeout_s=1.5, shm=True)
        channel = comm._channel(group, x)  # opening is collective; the collective itself only rank 0 runs
        if group.rank == 0:
            if case == "exited":
                channel.pids[1] = dead_pid  # as if rank 1 had died
            error = CollectiveTimeout if case == "timeout" else CollectiveError
            with pytest.raises(error, match="timed out|did not complete" if case == "timeout" else "exited"):
                comm.all_reduce(x, group).wait()
            with pytest.raises(CollectiveError, match="earlier shared-memory collective"):
                comm.all_reduce(x, group).wait()  # the channel stays failed: its ranks are out of step
        dist.barrier()


def _peer_exits_during_coalesced_gathers(dead_pid: int) -> None:
    group, _, _ = _setup(SMALL_REGION)
    shards = [torch.ones(n) for n in (3, 300, 5)]  # the second spans two pieces
    outputs = [torch.empty(2 * s.numel()) for s in shards]
    comm = Collectives(timeout_s=30, shm=True)
    channel = comm._channel(group, shards[0])
    if group.rank == 0:
        channel.pids[1] = dead_pid
        for pending in comm.all_gather_coalesced(outputs, shards, group):  # each fails at once, none waits 30 s
            with pytest.raises(CollectiveError, match="exited"):
                pending.wait()
        for pending in comm.all_gather_coalesced(outputs, shards, group):
            with pytest.raises(CollectiveError, match="earlier shared-memory collective"):
                pending.wait()
    dist.barrier()


def test_a_peer_lost_in_coalesced_gathers_fails_every_one_of_them():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    started = time.monotonic()
    run_distributed(_peer_exits_during_coalesced_gathers, 2, child.pid, timeout=60)
    assert time.monotonic() - started < 25


def test_a_missing_peer_is_a_named_error_not_a_hang():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # a pid that no longer exists
    run_distributed(_peer_never_arrives, 2, child.pid, timeout=60)


def _worker_wakeups_while_a_peer_is_late(late_s: float) -> int | None:
    """Rank 1 joins an all-reduce `late_s` after rank 0; rank 0 returns how often its channel's worker was woken
    (voluntary context switches) while it waited."""
    group, ours, _ = _setup(shm.REGION_BYTES)
    x = torch.ones(4)
    ours.all_reduce(x, group).wait()  # opens the channel (and its worker) on both ranks
    worker = next(t for t in threading.enumerate() if t.name.startswith("shardwise-shm"))

    def switches() -> int:
        with open(f"/proc/self/task/{worker.native_id}/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("voluntary_ctxt_switches"))

    dist.barrier()
    if group.rank == 1:
        time.sleep(late_s)
    before = switches()
    ours.all_reduce(x, group).wait()
    assert torch.equal(x, torch.full((4,), 4.0))
    return switches() - before if group.rank == 0 else None


def test_a_worker_waiting_for_a_late_peer_sleeps_until_woken_rather_than_polling():
    """[Note: waiting without polling]: a worker polling with sleeps backing off to 1 ms woke ~500 times in the
    half second; sleeping on the peer's counter, it is woken by the peer's publish."""
    wakeups = run_distributed(_worker_wakeups_while_a_peer_is_late, 2, 0.5)[0]
    assert wakeups <= 20, f"the waiting worker was woken {wakeups} times in 0.5 s"
