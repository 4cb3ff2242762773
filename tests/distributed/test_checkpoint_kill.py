"""A rank SIGKILLed at any moment of a save never leaves a checkpoint that `latest` names broken."""

from __future__ import annotations

import os
import signal
import threading
import time

import torch
import torch.distributed as dist

import shardwise
from shardwise.checkpoint import CheckpointReader
from tests.harness import RankFailure, run_distributed

CONFIG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 2}}


def _engine():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(768, 768) for _ in range(4)])
    engine, *_ = shardwise.initialize(model=model, config=CONFIG)
    return engine


def _step(engine):
    engine.backward(engine(torch.randn(2, 768)).square().mean())
    engine.step()


def _save_and_maybe_die(root, delay, tag):
    engine = _engine()
    _step(engine)
    if delay is None:
        engine.save_checkpoint(root, tag="first")
    if dist.get_rank() == 1 and delay is not None:
        threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    start = time.perf_counter()
    engine.save_checkpoint(root, tag=tag)
    return time.perf_counter() - start


def _resume(root):
    engine = _engine()
    path, _ = engine.load_checkpoint(root)
    _step(engine)
    return path


def test_sigkill_during_save_leaves_latest_loadable(tmp_path):
    duration = max(run_distributed(_save_and_maybe_die, 2, str(tmp_path), None, "calibrate", timeout=120))
    for trial in range(5):
        delay = duration * trial / 4  # from the very start of the save to its end
        try:
            run_distributed(_save_and_maybe_die, 2, str(tmp_path), delay, f"trial{trial}", timeout=120)
        except RankFailure as e:  # rank 1 died, or rank 0 lost its peer mid-save
            assert "rank 1 died" in str(e) or "save_checkpoint" in str(e), str(e)[-2000:]
        latest = (tmp_path / "latest").read_text()
        reader = CheckpointReader(tmp_path)  # verifies the manifest; checksums on access
        for name in reader.meta["files"]:
            reader.file(name)
        loaded = run_distributed(_resume, 2, str(tmp_path), timeout=120)[0]
        assert loaded.endswith(latest)
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert all(name.endswith(".partial") or name.endswith(".tmp") for name in leftovers)
