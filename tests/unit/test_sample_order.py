"""The epoch-position arithmetic of the loader (no process group): DistributedSampler's order for an
unchanged layout, and each remaining sample read once after a resume at another data-parallel size or
micro-batch size (ranks simulated in one process, reading in lockstep as they do in training)."""

from __future__ import annotations

import itertools
import logging
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from shardwise.runtime.data import DistributedLoader, RepeatingLoader
from shardwise.runtime.sample_order import epoch_order, rank_share


def _data(n):
    return TensorDataset(torch.arange(n))


def _torch_order(n, dp, rank, seed, epoch, drop_last):
    sampler = DistributedSampler(_data(n), num_replicas=dp, rank=rank, shuffle=True, seed=seed, drop_last=drop_last)
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_fresh_epoch_is_distributed_samplers_order(drop_last):
    for n, dp, seed, epoch in itertools.product((1, 5, 10, 12, 37), (1, 2, 3, 4), (0, 7), (0, 3)):
        order = epoch_order(n, seed, epoch)
        for rank in range(dp):
            assert rank_share(order, 0, rank, dp, drop_last) == _torch_order(n, dp, rank, seed, epoch, drop_last), \
                (n, dp, rank, seed, epoch)


@pytest.mark.parametrize("drop_last", [False, True])
def test_the_loader_batches_are_those_of_a_dataloader_over_distributed_sampler(drop_last):
    data = _data(23)
    for dp, micro, epoch in itertools.product((1, 2, 3), (1, 4, 5), (0, 1)):
        for rank in range(dp):
            sampler = DistributedSampler(data, num_replicas=dp, rank=rank, shuffle=True, seed=3, drop_last=drop_last)
            sampler.set_epoch(epoch)
            expected = [b.tolist() for (b,) in DataLoader(data, batch_size=micro, sampler=sampler, drop_last=drop_last)]
            loader = DistributedLoader(data, micro, rank, dp, seed=3, drop_last=drop_last)
            loader.set_epoch(epoch)
            assert [b.tolist() for (b,) in loader] == expected and len(loader) == len(expected)


def _loaders(n, dp, micro, drop_last=False, epoch=0, state=None):
    loaders = [DistributedLoader(_data(n), micro, rank, dp, seed=5, drop_last=drop_last) for rank in range(dp)]
    for loader in loaders:
        loader.set_epoch(epoch)
        if state is not None:
            loader.load_state_dict(state)
    return loaders


def _read(loaders, batches=None):
    """Every rank reads `batches` micro-batches (all when None), in lockstep; the ids per rank."""
    iterators = [iter(loader) for loader in loaders]
    read = [[] for _ in loaders]
    for _ in itertools.count() if batches is None else range(batches):
        step = [next(it, None) for it in iterators]
        if step[0] is None:
            assert all(s is None for s in step), "ranks read different numbers of batches"
            break
        for ids, (batch,) in zip(read, step):
            ids.append(batch.tolist())
    return read, iterators


def _flat(per_rank):
    return [i for rank in per_rank for batch in rank for i in batch]


LAYOUT_CHANGES = [  # (n, (dp, micro) saved, batches read per rank, (dp, micro) resumed)
    (40, (2, 4), 3, (1, 4)),   # dp 2 -> 1 with the same micro-batch
    (40, (1, 4), 3, (2, 4)),   # dp 1 -> 2
    (40, (2, 4), 2, (4, 1)),   # dp 2 -> 4
    (40, (2, 4), 3, (2, 2)),   # micro 4 -> 2
    (40, (2, 1), 5, (2, 4)),   # micro 1 -> 4
    (41, (2, 3), 3, (3, 2)),   # dp 2 -> 3: 23 left, padded to 24
    (10, (3, 1), 3, (2, 1)),   # dp 3 -> 2: one sample left, padded with the epoch's first
]


@pytest.mark.parametrize("n, saved, batches, resumed", LAYOUT_CHANGES)
def test_a_resumed_epoch_reads_each_remaining_sample_once_in_epoch_order(n, saved, batches, resumed):
    first = _loaders(n, *saved, epoch=2)
    assert first[0].state_dict()["consumed"] == 0
    before, _ = _read(first, batches)
    state = first[0].state_dict()
    order = epoch_order(n, 5, 2)
    consumed = batches * saved[0] * saved[1]
    assert state == {"epoch": 2, "consumed": consumed, "seed": 5, "dataset_size": n}
    assert sorted(_flat(before)) == sorted(order[:consumed])
    after, _ = _read(_loaders(n, *resumed, state=state))
    dp, micro = resumed
    padding = -(n - consumed) % dp  # DistributedSampler's: the epoch's first samples again
    assert Counter(_flat(before) + _flat(after)) == Counter(order + order[:padding])
    # Rank r reads every dp-th of the positions left, in micro-batches: round k covers [k·micro·dp, (k+1)·micro·dp).
    left = order[consumed:] + order[:padding]
    for rank, batches_of_rank in enumerate(after):
        assert [i for b in batches_of_rank for i in b] == left[rank::dp]
        assert all(len(b) == micro for b in batches_of_rank[:-1])


def test_an_unchanged_layout_resumes_bit_identically():
    whole, _ = _read(_loaders(41, 3, 2, epoch=1))
    first = _loaders(41, 3, 2, epoch=1)
    head, _ = _read(first, 4)
    tail, _ = _read(_loaders(41, 3, 2, state=first[0].state_dict()))
    assert [h + t for h, t in zip(head, tail)] == whole


def test_drop_last_cuts_the_tail_of_the_resumed_epoch():
    first = _loaders(23, 2, 3, drop_last=True)
    _read(first, 2)  # 12 of 23 read
    tail, _ = _read(_loaders(23, 3, 2, drop_last=True, state=first[0].state_dict()))
    left = epoch_order(23, 5, 0)[12:21]  # 11 left, cut to 9 for 3 ranks; each reads one whole micro-batch of 2
    assert tail == [[left[r::3][:2]] for r in range(3)]


def test_a_checkpoint_after_the_epochs_last_batch_resumes_into_the_next_epoch():
    """The last round holds the padding (41 samples over 3 ranks: one repeated); once it is read the epoch is
    finished, whatever layout resumes, so the padded repeat is never read twice nor taken as a position, and
    the resumed loader's first pass (plain iteration or a RepeatingLoader) is the next epoch."""
    first = _loaders(41, 3, 2)
    _read(first, 7)  # all 7 micro-batches per rank: 42 positions, the last one padding
    state = first[0].state_dict()
    assert state["consumed"] == 41
    direct = _loaders(41, 2, 1, state=state)
    per_rank = _read(direct)[0]  # the first pass after the resume is epoch 1, whole (it used to yield nothing)
    order = epoch_order(41, 5, 1)
    assert direct[0].epoch == 1 and [len(batches) for batches in per_rank] == [21, 21]
    assert [batches[0] for batches in per_rank] == [[order[0]], [order[1]]]
    resumed = _loaders(41, 2, 1, state=state)
    repeating = RepeatingLoader(resumed[0])
    assert next(repeating)[0].tolist() == [epoch_order(41, 5, 1)[0]]
    assert resumed[0].epoch == 1 and resumed[0].state_dict()["consumed"] == 2


def test_set_epoch_keeps_a_resume_position_for_its_own_epoch_only():
    first = _loaders(40, 2, 4, epoch=3)
    _read(first, 2)
    state = first[0].state_dict()
    same = _loaders(40, 1, 8, state=state)
    same[0].set_epoch(3)  # an epoch loop that sets the epoch again after loading
    assert len(_flat(_read(same)[0])) == 24
    other = _loaders(40, 1, 8, state=state)
    other[0].set_epoch(4)
    assert sorted(_flat(_read(other)[0])) == list(range(40))


def test_an_old_checkpoint_state_loads_with_a_warning(caplog):
    """`batches_seen` per rank: converted with the saving layout when the checkpoint says it, else this one."""
    first = _loaders(40, 2, 4, epoch=1)
    head, _ = _read(first, 3)
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        resumed = _loaders(40, 1, 4, state={"epoch": 1, "batches_seen": 3, "micro_batch_size": 4, "dp_size": 2})
    assert "batches_seen=3, an older format" in caplog.text
    assert "taken as 3 × micro-batch 4 × 2 data-parallel ranks = 24 samples of epoch 1" in caplog.text
    assert sorted(_flat(head) + _flat(_read(resumed)[0])) == list(range(40))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        unchanged = _loaders(40, 2, 4, state={"epoch": 1, "batches_seen": 3})
    assert "taken as 3 × micro-batch 4 × 2 data-parallel ranks = 24 samples" in caplog.text
    assert sorted(_flat(head) + _flat(_read(unchanged)[0])) == list(range(40))


def test_a_changed_dataset_or_seed_is_named(caplog):
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        grown = _loaders(44, 2, 4, state={"epoch": 1, "consumed": 8, "seed": 5, "dataset_size": 40})
    assert ("the checkpoint's epoch 1 is an order of 40 samples, the dataset now has 44, so which samples it "
            "consumed is unknown; the loader starts epoch 2 from its beginning instead") in caplog.text
    assert grown[0].epoch == 2 and sorted(_flat(_read(grown)[0])) == list(range(44))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        reseeded = _loaders(40, 2, 4, state={"epoch": 1, "consumed": 8, "seed": 9, "dataset_size": 40})
    assert "seeded with 9, this loader's with 5" in caplog.text
    assert sorted(_flat(_read(reseeded)[0])) == sorted(epoch_order(40, 9, 1)[8:])
