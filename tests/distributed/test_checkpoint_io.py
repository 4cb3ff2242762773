"""What a checkpoint costs in I/O and time: a loading rank deserialises only the slices it holds, and an
async save writes while training goes on."""

from __future__ import annotations

import collections
import os
import threading
from pathlib import Path

import shardwise
from tests.harness import run_distributed
from tests.parity import ds_config, make_model, param_groups, train_steps

TRAINABLE = sum(p.numel() for p in make_model().parameters() if p.requires_grad)
FROZEN = sum(p.numel() for p in make_model().parameters() if not p.requires_grad)


def _engine(stage: int, world: int, **extra):
    model = make_model()
    shardwise.zero.register_external_parameter(model, model.embed.weight)
    zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
    config = ds_config(12 // world, 1, zero_optimization=zero, **extra)
    engine, *_ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=config)
    return engine


def _save_whole(root: str) -> None:
    engine = _engine(0, 1)
    train_steps(engine, 0, 2)
    engine.save_checkpoint(root)


def _load_counting(root: str, stage: int) -> dict[str, int]:
    """Load, counting the bytes deserialised from the checkpoint's tensors, by kind (master, value, state.*)."""
    from shardwise.checkpoint.safetensors_file import SafetensorsFile

    counted: collections.Counter[str] = collections.Counter()
    read_range = SafetensorsFile.read_range

    def counting(self, key, lo, hi):
        out = read_range(self, key, lo, hi)
        counted[key.split("|")[1]] += out.numel() * out.element_size()
        return out

    SafetensorsFile.read_range = counting  # this rank's process only (forked), for its lifetime
    _engine(stage, 2).load_checkpoint(root)
    return dict(counted)


def test_a_loading_rank_reads_only_the_slices_it_holds(tmp_path):
    # One file holds everything (world size 1, stage 0); two ranks load it at stages that partition the state.
    run_distributed(_save_whole, 1, str(tmp_path))
    trainable_kinds = ("master", "state.exp_avg", "state.exp_avg_sq")
    for stage in (1, 2, 3):
        ranks = run_distributed(_load_counting, 2, str(tmp_path), stage)
        for kind in trainable_kinds:
            # Every fp32 element (4 bytes) of each kind read once over both ranks, about half by each (a partition
            # boundary may fall one element off the middle; stage 3 pads each parameter group to an even size).
            assert sum(r[kind] for r in ranks) == 4 * TRAINABLE, (stage, kind, ranks)
            assert all(abs(r[kind] - 4 * TRAINABLE / 2) <= 4 * 8 for r in ranks), (stage, kind, ranks)
        # The frozen parameter: whole on every rank at stages 1-2 (parameters are not partitioned), half at stage 3.
        assert [r["value"] for r in ranks] == [4 * FROZEN // (2 if stage == 3 else 1)] * 2, (stage, ranks)


def _save_while_training(root: str):
    """Hold the background writer at its first fsync while a whole training step runs on the main thread."""
    engine = _engine(2, 2, checkpoint={"async_save": True})
    train_steps(engine, 0, 2)
    release, reached = threading.Event(), threading.Event()
    writers: list[threading.Thread] = []
    fsync = os.fsync

    def held_fsync(fd: int) -> None:
        if threading.current_thread() is not threading.main_thread():
            writers.append(threading.current_thread())
            reached.set()
            release.wait(60)
        fsync(fd)

    os.fsync = held_fsync
    try:
        engine.save_checkpoint(root)
        writing = reached.wait(20)  # a thread other than the caller's is writing the checkpoint
        losses = train_steps(engine, 2, 1)  # the step returns while that write is held
        during = {"writing": writing, "writer_alive": bool(writers) and writers[0].is_alive(),
                  "tag_exists": (Path(root) / "global_step2").exists(), "latest_exists": (Path(root) / "latest").exists()}
    finally:
        release.set()
        os.fsync = fsync
    engine.destroy()  # waits for the write
    after = {"tag_exists": (Path(root) / "global_step2").exists(), "latest": (Path(root) / "latest").read_text()}
    resumed = _engine(2, 2)
    resumed.load_checkpoint(root)
    return during, after, losses, train_steps(resumed, 2, 1)


def test_async_save_writes_in_the_background(tmp_path):
    for during, after, losses, resumed in run_distributed(_save_while_training, 2, str(tmp_path), timeout=180):
        assert during == {"writing": True, "writer_alive": True, "tag_exists": False, "latest_exists": False}
        assert after == {"tag_exists": True, "latest": "global_step2"}
        assert resumed == losses  # the checkpoint holds the state at the call, not after the step taken meanwhile
