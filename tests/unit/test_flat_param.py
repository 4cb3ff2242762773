"""Pure bucket/partition layout math."""

from __future__ import annotations

import pytest

from shardwise.zero.flat_param import plan_buckets, round_up


def test_buckets_respect_cap_and_keep_tensors_whole():
    buckets = plan_buckets([5, 5, 5, 20, 3], bucket_numel=12)
    assert [[s.index for s in b.slots] for b in buckets] == [[0, 1], [2], [3], [4]]
    assert [b.numel for b in buckets] == [10, 5, 20, 3]
    assert buckets[0].slots[1].offset == 5


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_padding_gives_equal_contiguous_shards(world):
    (bucket,) = plan_buckets([7, 11], bucket_numel=100, align=world)
    assert bucket.padded_numel == round_up(18, world) and bucket.padded_numel % world == 0
    ranges = [bucket.shard_range(r, world) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == bucket.padded_numel
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="must be positive"):
        plan_buckets([1], bucket_numel=0)
