"""A checkpoint saved at the end of an epoch, then loaded, as the CIFAR-10 tutorial's loop does it: the loader
`initialize` returned reads the next epoch whole on its first pass. It used to yield no batch at all, so the
tutorial printed "Finished Training" having trained nothing; DeepSpeed's loader starts a fresh pass."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

import shardwise
from tests.harness import run_distributed
from tests.parity import SEQ, VOCAB, ds_config, make_model, param_groups

N = 24


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.arange(N), torch.randint(0, VOCAB, (N, SEQ), generator=g),
                         torch.randint(0, VOCAB, (N, SEQ), generator=g))


def _epoch(root: str, load: bool) -> dict:
    """One pass over the built-in loader (training every batch), then a save; what was read and stepped."""
    model = make_model()
    engine, _, loader, _ = shardwise.initialize(model=model, model_parameters=param_groups(model),
                                                training_data=_dataset(), config=ds_config(2, 1))
    if load:
        engine.load_checkpoint(root)
    start, read = engine.global_steps, []
    for ids, tokens, labels in loader:
        engine.backward(engine(tokens, labels))
        engine.step()
        read += ids.tolist()
    engine.save_checkpoint(root)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, read)
    return {"steps": engine.global_steps - start, "read": sorted(i for ids in every for i in ids),
            "epoch": loader.epoch}


def test_the_first_pass_after_an_end_of_epoch_resume_reads_the_next_epoch(tmp_path: Path) -> None:
    first = run_distributed(_epoch, 2, str(tmp_path), False)[0]
    resumed = run_distributed(_epoch, 2, str(tmp_path), True)[0]
    assert first == {"steps": N // 4, "read": list(range(N)), "epoch": 0}
    assert resumed == {"steps": N // 4, "read": list(range(N)), "epoch": 1}
