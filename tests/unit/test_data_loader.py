"""The distributed loader: disjoint rank slices, reshuffling per epoch, exact mid-epoch resume."""

from __future__ import annotations

import itertools

import torch
from torch.utils.data import TensorDataset

from shardwise.runtime.data import DistributedLoader, RepeatingLoader

DATA = TensorDataset(torch.arange(40))


def _ids(loader, n=None):
    return [i for (batch,) in itertools.islice(loader, n) for i in batch.tolist()]


def test_ranks_read_disjoint_slices_covering_the_data():
    a, b = (_ids(DistributedLoader(DATA, 4, rank, 2, seed=1)) for rank in (0, 1))
    assert not set(a) & set(b) and sorted(a + b) == list(range(40))


def test_set_epoch_reshuffles_deterministically():
    loaders = [DistributedLoader(DATA, 4, rank, 2, seed=1) for rank in (0, 1)]
    first = [_ids(loader) for loader in loaders]
    for loader in loaders:
        loader.set_epoch(1)
    second = [_ids(loader) for loader in loaders]
    assert first != second and sorted(second[0] + second[1]) == list(range(40))
    assert _ids(DistributedLoader(DATA, 4, 0, 2, seed=1)) == first[0]


def test_resume_mid_epoch_continues_exactly():
    loader = DistributedLoader(DATA, 4, 0, 2, seed=1)
    loader.set_epoch(2)
    whole = _ids(loader)
    partial = DistributedLoader(DATA, 4, 0, 2, seed=1)
    partial.set_epoch(2)
    head = _ids(partial, n=2)
    state = partial.state_dict()
    resumed = DistributedLoader(DATA, 4, 0, 2, seed=1)
    resumed.load_state_dict(state)
    assert state == {"epoch": 2, "consumed": 16, "seed": 1, "dataset_size": 40}  # 2 batches of 4 on each of 2 ranks
    assert head + _ids(resumed) == whole


def test_resume_from_the_end_of_an_epoch_reads_the_next_epoch():
    """A checkpoint saved when an epoch was read to its end: the resumed loader's first pass is the next epoch
    (it used to yield no batch at all, and a tutorial loop ended having trained nothing)."""
    finished = DistributedLoader(DATA, 4, 0, 2, seed=1, drop_last=True)
    _ids(finished)
    state = finished.state_dict()
    expected = DistributedLoader(DATA, 4, 0, 2, seed=1, drop_last=True)
    expected.set_epoch(1)
    for layout in ((4, 2), (3, 2), (4, 1)):  # the same layout, and others: every one has nothing left of epoch 0
        resumed = DistributedLoader(DATA, *layout[:1], 0, layout[1], seed=1, drop_last=True)
        resumed.load_state_dict(state)
        ids = _ids(resumed)
        assert resumed.epoch == 1 and len(ids) == len(resumed) * layout[0] > 0
        if layout == (4, 2):
            assert ids == _ids(expected)
    assert state == {"epoch": 0, "consumed": 40, "seed": 1, "dataset_size": 40}


def test_a_resume_with_a_partial_batch_left_still_reads_it():
    partial = DistributedLoader(DATA, 4, 0, 2, seed=1)
    resumed = DistributedLoader(DATA, 4, 0, 2, seed=1)
    resumed.load_state_dict({**partial.state_dict(), "consumed": 36})  # 4 samples left: 2 per rank
    assert resumed.epoch == 0 and len(_ids(resumed)) == 2


def test_repeating_loader_moves_to_the_next_epoch():
    loader = DistributedLoader(DATA, 4, 0, 2, seed=1)
    repeating = RepeatingLoader(loader)
    seen = [next(repeating)[0].tolist() for _ in range(7)]
    assert loader.epoch == 1 and len(seen) == 7


def _rng_after(first_batch) -> torch.Tensor:
    torch.manual_seed(0)
    first_batch()
    return torch.rand(3)


def test_a_fresh_pass_draws_from_the_global_rng_as_deepspeeds_loader_does():
    """DeepSpeed's loader is a torch DataLoader over a DistributedSampler: each pass draws one number from the
    global RNG. Drawing the same keeps a script's dropout masks in step with its DeepSpeed run."""
    from torch.utils.data import DataLoader, DistributedSampler

    deepspeeds = _rng_after(lambda: next(iter(DataLoader(DATA, 4, sampler=DistributedSampler(DATA, 2, 0)))))
    assert not torch.equal(deepspeeds, _rng_after(lambda: None))  # the premise: it does draw
    assert torch.equal(_rng_after(lambda: next(iter(DistributedLoader(DATA, 4, 0, 2, seed=1)))), deepspeeds)
    second_epoch = DistributedLoader(DATA, 4, 0, 2, seed=1)
    _ids(second_epoch)
    second_epoch.set_epoch(1)
    assert torch.equal(_rng_after(lambda: next(iter(second_epoch))), deepspeeds)


def test_a_pass_resumed_mid_epoch_leaves_the_global_rng_alone():
    """The run it continues drew when the epoch began: a second draw would shift every later random number."""
    resumed = DistributedLoader(DATA, 4, 0, 2, seed=1)
    resumed.load_state_dict({**resumed.state_dict(), "consumed": 16})
    assert torch.equal(_rng_after(lambda: next(iter(resumed))), _rng_after(lambda: None))


def test_a_pass_that_yields_no_batch_says_so(caplog):
    """Issue 42 item 1: an epoch that yields nothing must never pass silently (a training loop over it ends at once)."""
    tiny = TensorDataset(torch.arange(3.0))
    loader = DistributedLoader(tiny, micro_batch_size=2, dp_rank=0, dp_size=2, drop_last=True)
    with caplog.at_level("WARNING", logger="shardwise"):
        assert list(loader) == []
    assert "yields no batch: the dataset's 3 samples make less than one micro-batch of 2 per rank over 2" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="shardwise"):
        assert len(list(DistributedLoader(tiny, micro_batch_size=2, dp_rank=0, dp_size=1))) == 2
    assert "yields no batch" not in caplog.text
