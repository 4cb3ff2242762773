"""A collective on a group of one (a single-device run): nothing to exchange, so nothing to copy in place."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardwise.distributed import Collectives
from shardwise.distributed.topology import Group


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_group_of_one_reduces_and_gathers_in_place_without_touching_the_data():
    """ZeRO at world 1 asks for its own (whole) chunk in place: a 135 MB reduce-scatter used to clone the
    buffer and copy it onto itself, the all-gather to copy it onto itself (10 % of a ZeRO-2 step on CPU)."""
    comm, group = Collectives(), Group("data", None, 1, 0)
    flat = torch.arange(8.0)
    own_chunk, own_shard = flat.view(1, -1)[0], flat[0:8]  # as ZeRO's reducer and all-gather name them
    with _Ops() as ops:
        comm.reduce_scatter(own_chunk, flat, group).wait()
        comm.all_gather(flat, own_shard, group).wait()
    assert ops.seen == []
    assert torch.equal(flat, torch.arange(8.0))
    # Another output is filled, and both count as collectives.
    out, gathered = torch.zeros(8), torch.zeros(8)
    comm.reduce_scatter(out, flat, group).wait()
    comm.all_gather(gathered, flat, group).wait()
    assert torch.equal(out, flat) and torch.equal(gathered, flat)
    assert comm.stats.calls("reduce_scatter") == 2 and comm.stats.calls("all_gather") == 2
