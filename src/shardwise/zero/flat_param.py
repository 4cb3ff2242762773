"""Pure layout math for flat buffers: which tensor sits where, and how buffers split into buckets.

No torch.distributed here; tested without processes.

[Note: flat-buffer padding] A bucket's length is rounded up to a multiple of `align` (the number of
ranks that will share it) so that every rank owns an equal, contiguous slice. The padding elements
are zero in gradients and never read into parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class Slot:
    """Where tensor `index` lives in its bucket: elements [offset, offset + numel)."""

    index: int
    offset: int
    numel: int


@dataclass(frozen=True)
class BucketLayout:
    slots: tuple[Slot, ...]
    numel: int
    """Elements used by tensors."""
    padded_numel: int
    """`numel` rounded up to the alignment: the length of the bucket's buffer."""

    def shard_range(self, rank: int, world: int) -> tuple[int, int]:
        """The [start, end) slice of this bucket owned by `rank` of `world`."""
        size = self.padded_numel // world
        return rank * size, (rank + 1) * size

    def owned(self, slot: Slot, rank: int, world: int) -> tuple[int, int, int]:
        """(start, end, at): the flat elements [start, end) of `slot`'s tensor that `rank`'s shard holds, at
        the shard's elements [at, at + end - start). Empty (start == end) when the shard holds none of them."""
        lo, hi = self.shard_range(rank, world)
        first, last = max(lo, slot.offset), max(min(hi, slot.offset + slot.numel), lo)
        first = min(first, last)
        return first - slot.offset, last - slot.offset, first - lo

    def pieces(self, rank: int, world: int) -> Iterator[tuple[int, int, int, int]]:
        """(slot position, start, end, at) of `owned` for every slot with elements in `rank`'s shard, in order."""
        for position, slot in enumerate(self.slots):
            start, end, at = self.owned(slot, rank, world)
            if start < end:
                yield position, start, end, at


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def plan_buckets(numels: list[int], bucket_numel: int, align: int = 1) -> list[BucketLayout]:
    """Pack tensors, in the given order, into buckets of at most `bucket_numel` elements.

    A tensor larger than the cap gets a bucket of its own (never split), so a bucket is always a
    whole number of tensors and a tensor's gradient is ready in exactly one bucket.
    """
    if bucket_numel < 1 or align < 1:
        raise ValueError(f"bucket_numel ({bucket_numel}) and align ({align}) must be positive.")
    buckets: list[BucketLayout] = []
    slots: list[Slot] = []
    used = 0
    for index, numel in enumerate(numels):
        if slots and used + numel > bucket_numel:
            buckets.append(BucketLayout(tuple(slots), used, round_up(used, align)))
            slots, used = [], 0
        slots.append(Slot(index, used, numel))
        used += numel
    if slots:
        buckets.append(BucketLayout(tuple(slots), used, round_up(max(used, 1), align)))
    return buckets
