"""Checkpoints: exact resume, resharding across world sizes and stages, corruption and strictness."""

from __future__ import annotations

import json

import pytest
import torch

import shardwise
from shardwise.checkpoint import CheckpointError
from tests.harness import RankFailure, run_distributed
from tests.parity import train_steps, ds_config, make_model, param_groups

SCHEDULER = {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 3, "total_num_steps": 40, "warmup_max_lr": 1e-2}}


def _config(stage, precision="fp32", world=2, accum=2):
    extra = {precision: {"enabled": True, "initial_scale_power": 8}} if precision == "fp16" else (
        {precision: {"enabled": True}} if precision == "bf16" else {})
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}
    # The same global batch (12) at world sizes 1-4, so runs at different layouts are comparable.
    return ds_config(12 // (accum * world), accum, clip=1.0, scheduler=SCHEDULER, zero_optimization=zero, **extra)


def _engine(config):
    model = make_model()
    shardwise.zero.register_external_parameter(model, model.embed.weight)
    engine, *_ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=config)
    return engine


def _train(engine, start, steps):
    return train_steps(engine, start, steps)


def _save_then_continue(root, configs):
    out = []
    for i, config in enumerate(configs):
        engine = _engine(config)
        _train(engine, 0, 4)
        path = engine.save_checkpoint(f"{root}/{i}", client_state={"epoch": 3})
        out.append((path, _train(engine, 4, 4)))
    return out


def _resume(root, configs):
    out = []
    for i, config in enumerate(configs):
        engine = _engine(config)
        path, client = engine.load_checkpoint(f"{root}/{i}")
        out.append((path, client, engine.global_steps, engine.get_lr(), _train(engine, 4, 4)))
    return out


EXACT = [(stage, precision) for stage in (0, 1, 2, 3) for precision in ("fp32", "bf16")] + [(2, "fp16")]


def test_exact_resume_every_stage_and_precision(tmp_path):
    configs = [_config(stage, precision) for stage, precision in EXACT]
    saved = run_distributed(_save_then_continue, 2, str(tmp_path), configs, timeout=400)[0]
    resumed = run_distributed(_resume, 2, str(tmp_path), configs, timeout=400)[0]
    for (stage, precision), (path, after), (loaded, client, steps, lr, again) in zip(EXACT, saved, resumed):
        assert loaded == path and client == {"epoch": 3} and steps == 4
        assert after == again, f"stage {stage} {precision}: {after} != {again}"  # bitwise on CPU
    assert (tmp_path / "0" / "latest").read_text() == "global_step4"
    assert not list(tmp_path.glob("*/.*partial"))


RESHARD = [  # (world, stage) saved -> (world, stage) loaded
    ((4, 3), (2, 2)),
    ((2, 2), (3, 3)),
    ((3, 3), (1, 1)),
    ((2, 1), (1, 0)),
]


def _save_at(root, stage, world):
    engine = _engine(_config(stage, world=world, accum=1))
    _train(engine, 0, 4)
    engine.save_checkpoint(root)
    return _train(engine, 4, 4)


def _load_at(root, stage, world):
    engine = _engine(_config(stage, world=world, accum=1))
    engine.load_checkpoint(root)
    return _train(engine, 4, 4)


@pytest.mark.parametrize("saved, loaded", RESHARD, ids=[f"{a}to{b}" for a, b in RESHARD])
def test_reshard_to_another_world_size_and_stage(tmp_path, saved, loaded):
    reference = run_distributed(_save_at, saved[0], str(tmp_path), saved[1], saved[0], timeout=300)[0]
    continued = run_distributed(_load_at, loaded[0], str(tmp_path), loaded[1], loaded[0], timeout=300)[0]
    for a, b in zip(continued, reference):
        assert abs(a - b) <= 1e-6 * abs(b), (continued, reference)


def test_corrupt_file_is_named(tmp_path):
    configs = [_config(0, world=1)]
    run_distributed(_save_then_continue, 1, str(tmp_path), configs)
    shard = tmp_path / "0" / "global_step4" / "rank0.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(RankFailure, match="rank0.safetensors: size or checksum differs from the manifest"):
        run_distributed(_resume, 1, str(tmp_path), configs)


def test_checkpoints_with_sha256_checksums_still_load_and_verify(tmp_path):
    """Manifests written before CRC32 record SHA-256: such a checkpoint loads, and a flipped byte is caught."""
    from shardwise.checkpoint import layout

    configs = [_config(0, world=1)]
    expected = run_distributed(_save_then_continue, 1, str(tmp_path), configs)[0]
    tag = tmp_path / "0" / "global_step4"
    meta = json.loads((tag / "manifest.json").read_text())
    entry = meta["files"]["rank0.safetensors"]
    entry["sha256"] = layout.sha256_of(tag / "rank0.safetensors")
    del entry["crc32"]
    (tag / "manifest.json").write_text(json.dumps(meta))
    resumed = run_distributed(_resume, 1, str(tmp_path), configs)[0]
    assert resumed[0][-1] == expected[0][1]  # the same 4 losses after the checkpoint
    data = bytearray((tag / "rank0.safetensors").read_bytes())
    data[-3] ^= 0xFF
    (tag / "rank0.safetensors").write_bytes(bytes(data))
    with pytest.raises(RankFailure, match="rank0.safetensors: size or checksum differs from the manifest"):
        run_distributed(_resume, 1, str(tmp_path), configs)


def test_missing_and_incompatible_checkpoints(tmp_path):
    configs = [_config(0, world=1)]
    with pytest.raises(RankFailure, match="no 'latest' file"):
        run_distributed(_resume, 1, str(tmp_path / "nowhere"), configs)
    run_distributed(_save_then_continue, 1, str(tmp_path), configs)
    manifest = tmp_path / "0" / "global_step4" / "manifest.json"
    meta = json.loads(manifest.read_text())
    meta["format_version"] = 99
    manifest.write_text(json.dumps(meta))
    with pytest.raises(RankFailure, match="format_version 99, this shardwise reads 2"):
        run_distributed(_resume, 1, str(tmp_path), configs)


def _strict(root):
    engine = _engine(_config(1, world=1))
    _train(engine, 0, 1)
    engine.save_checkpoint(root)
    model = make_model()
    model.extra = torch.nn.Linear(2, 2)
    other, *_ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=_config(1, world=1))
    try:
        other.load_checkpoint(root)
    except CheckpointError as e:
        message = str(e)
    other.load_checkpoint(root, load_module_strict=False)
    return message


def test_strict_loading_names_the_parameters(tmp_path):
    message = run_distributed(_strict, 1, str(tmp_path))[0]
    assert "Missing from the checkpoint: ['extra.bias', 'extra.weight']; in the checkpoint but not the model: []" in message


def test_client_state_must_be_json():
    def run():
        engine = _engine(_config(0, world=1))
        engine.save_checkpoint("/tmp/never", client_state={"x": object()})

    with pytest.raises(RankFailure, match="client_state: must be JSON-serialisable"):
        run_distributed(run, 1)


def _async_vs_sync(root):
    config = _config(2)
    out = []
    for mode in ("sync", "async"):
        engine = _engine({**config, "checkpoint": {"async_save": mode == "async"}})
        _train(engine, 0, 3)
        engine.save_checkpoint(f"{root}/{mode}")
        _train(engine, 3, 2)  # training goes on (and changes every tensor) while the write runs
        engine.checkpoint_writer.wait()
        resumed = _engine(config)
        resumed.load_checkpoint(f"{root}/{mode}")
        out.append(_train(resumed, 3, 2))
    return out


def test_async_save_captures_the_state_at_the_call(tmp_path):
    sync, background = run_distributed(_async_vs_sync, 2, str(tmp_path), timeout=300)[0]
    assert sync == background
