"""The choke point's gloo path (one broadcast / reduce per rank) against gloo's own flat collectives
(shared memory off: `test_shm_collectives.py` covers that path)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from shardwise.distributed import Collectives
from shardwise.distributed.topology import Group
from tests.harness import run_distributed


def _compare_with_gloo(chunk: int) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = Group("data", dist.group.WORLD, world, rank)
    per_rank, native = Collectives(shm=False), Collectives(shm=False, per_rank_on_gloo=False)
    torch.manual_seed(rank)
    grads = torch.randn(world * chunk)

    ours, theirs = torch.empty(chunk), torch.empty(chunk)
    native.reduce_scatter(theirs, grads.clone(), group).wait()
    per_rank.reduce_scatter(ours, grads.clone(), group).wait()
    torch.testing.assert_close(ours, theirs)  # the same sum, maybe in another order
    # The result may be asked for in place, in this rank's own chunk of the input.
    for comm in (per_rank, native):
        in_place = grads.clone()
        pending = comm.reduce_scatter(in_place[rank * chunk : (rank + 1) * chunk], in_place, group)
        deadline = time.monotonic() + 20
        # Per rank, it completes with nobody waiting and says so without blocking (gradient buckets rely on
        # that to free buffers during backward). Gloo's own reduce-scatter reports completion only once waited.
        while comm is per_rank and not pending.done():
            assert time.monotonic() < deadline, "done() never turned true"
            time.sleep(0.001)
        pending.wait()
        torch.testing.assert_close(in_place[rank * chunk : (rank + 1) * chunk], theirs)

    shard = torch.full((chunk,), float(rank + 1)) + torch.arange(chunk)
    expected = torch.empty(world * chunk)
    native.all_gather(expected, shard, group).wait()
    gathered = torch.empty(world * chunk)
    per_rank.all_gather(gathered, shard, group).wait()
    assert torch.equal(gathered, expected)
    for comm in (per_rank, native):  # in place: the shard is this rank's chunk of the output
        own = torch.zeros(world * chunk)
        own[rank * chunk : (rank + 1) * chunk] = shard
        comm.all_gather(own, own[rank * chunk : (rank + 1) * chunk], group).wait()
        assert torch.equal(own, expected)
    # Counted as one logical collective each, with the flat tensor's elements.
    assert per_rank.stats.calls("all_gather") == 2 and per_rank.stats.calls("reduce_scatter") == 2
    assert native.stats.calls("reduce_scatter") == 2
    assert per_rank.stats.elements("all_gather") == 2 * world * chunk


def test_per_rank_collectives_equal_gloo_flat_collectives():
    run_distributed(_compare_with_gloo, 3, 1001)
