"""Which samples each data-parallel rank reads in an epoch, and where a resumed epoch continues.

Pure arithmetic (no process group), used by `runtime/data.py`.

[Note: epoch position] An epoch's order is one seeded permutation of the dataset, the one torch's
DistributedSampler draws with shuffling (`randperm` seeded with seed + epoch). Ranks read it round-robin:
rank r of dp takes positions r, r + dp, r + 2·dp, ... in micro-batches of m. So once every rank has read
b micro-batches, the samples consumed are exactly the first b·m·dp positions of the order, whatever the
layout: that count, the epoch position, is what a checkpoint keeps. A resumed loader hands rank r of dp'
the positions `order[position:][r::dp']` in micro-batches of m'; for an unchanged layout this is the
uninterrupted run's order, bit for bit.

Ranks must read equally many micro-batches (they meet in collectives), so the remaining positions are
made a multiple of dp' as DistributedSampler does: without drop_last they are padded by repeating the
epoch's first samples, with drop_last the tail is cut. Padding and a partial micro-batch are only ever
read in an epoch's last round, and a position taken after that round is the dataset size (the epoch is
finished), so a padded duplicate never moves where a resumed epoch starts and is never counted twice.
"""

from __future__ import annotations

import itertools

import torch


def epoch_order(dataset_size: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The epoch's permutation of dataset indices: DistributedSampler's (with shuffling, or in order)."""
    if not shuffle:
        return list(range(dataset_size))
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(dataset_size, generator=generator).tolist()


def share_size(remaining: int, dp_size: int, drop_last: bool) -> int:
    """How many samples each rank reads of the `remaining` positions of an epoch."""
    return remaining // dp_size if drop_last else -(-remaining // dp_size)


def rank_share(order: list[int], position: int, dp_rank: int, dp_size: int, drop_last: bool) -> list[int]:
    """Rank `dp_rank`'s indices for the rest of the epoch, once `position` samples of `order` are consumed."""
    remaining = order[position:]
    if drop_last:
        remaining = remaining[: len(remaining) - len(remaining) % dp_size]
    elif order:
        padding = -len(remaining) % dp_size
        remaining += list(itertools.islice(itertools.cycle(order), padding))
    return remaining[dp_rank::dp_size]


def batch_count(share: int, micro_batch_size: int, drop_last: bool) -> int:
    """Micro-batches a rank reads from a share of `share` samples."""
    return share // micro_batch_size if drop_last else -(-share // micro_batch_size)


def position_after(start: int, batches_read: int, batches_total: int, micro_batch_size: int, dp_size: int,
                   dataset_size: int) -> int:
    """The epoch position once every rank has read `batches_read` of its `batches_total` micro-batches in
    an iteration that began at `start`; the dataset size once the last one is read (see the note)."""
    if batches_read >= batches_total:
        return dataset_size
    return start + batches_read * micro_batch_size * dp_size
