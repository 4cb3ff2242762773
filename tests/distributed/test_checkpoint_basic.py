"""Stage-0 checkpoints: an exact resume, atomic publication, corruption detection, no pickles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import shardwise
from shardwise.checkpoint import CheckpointError
from tests.harness import RankFailure, run_distributed
from tests.parity import ds_config, make_model, micro_batch, param_groups


def _engine(config):
    model = make_model()
    engine, *_ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=config)
    return engine


def _train(engine, steps, start):
    losses = []
    for step in range(start, start + steps):
        for m in range(engine.gradient_accumulation_steps()):
            batch = micro_batch(step, m, dist.get_rank(), engine.train_micro_batch_size_per_gpu(),
                                engine.gradient_accumulation_steps(), dist.get_world_size())
            loss = engine(*batch)
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    return losses


def _save_then_continue(save_dir, config):
    engine = _engine(config)
    _train(engine, 4, 0)
    path = engine.save_checkpoint(save_dir, client_state={"epoch": 3})
    return path, _train(engine, 3, 4), torch.get_rng_state()


def _resume(save_dir, config):
    engine = _engine(config)
    path, client = engine.load_checkpoint(save_dir)
    return path, client, engine.global_steps, _train(engine, 3, 4)


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_exact_resume(tmp_path, precision, stage):
    extra = {precision: {"enabled": True}} if precision != "fp32" else {}
    config = ds_config(2, 2, clip=1.0, zero_optimization={"stage": stage}, **extra)
    saved = run_distributed(_save_then_continue, 2, str(tmp_path), config)
    resumed = run_distributed(_resume, 2, str(tmp_path), config)
    for (path, after, _), (loaded_path, client, steps, again) in zip(saved, resumed):
        assert path == loaded_path and client == {"epoch": 3} and steps == 4
        assert after == again  # bitwise: same losses after resuming
    assert (tmp_path / "latest").read_text() == "global_step4"
    assert not list(tmp_path.glob(".*partial"))


def test_corrupt_file_is_named(tmp_path):
    run_distributed(_save_then_continue, 1, str(tmp_path), ds_config(2, 1))
    model_file = tmp_path / "global_step4" / "model.safetensors"
    data = bytearray(model_file.read_bytes())
    data[-3] ^= 0xFF
    model_file.write_bytes(bytes(data))
    with pytest.raises(RankFailure, match="model.safetensors: size or checksum differs"):
        run_distributed(_resume, 1, str(tmp_path), ds_config(2, 1))


def test_missing_checkpoint_message(tmp_path):
    with pytest.raises(RankFailure, match="no 'latest' file"):
        run_distributed(_resume, 1, str(tmp_path / "nowhere"), ds_config(2, 1))


def test_manifest_is_json_and_no_pickles(tmp_path):
    run_distributed(_save_then_continue, 2, str(tmp_path), ds_config(2, 1))
    tag = tmp_path / "global_step4"
    meta = json.loads((tag / "manifest.json").read_text())
    assert meta["world_size"] == 2 and meta["counters"]["global_steps"] == 4
    assert sorted(meta["files"]) == ["model.safetensors", "state.rank0.safetensors", "state.rank1.safetensors"]
    assert all(p.suffix in (".json", ".safetensors") for p in tag.iterdir())
