"""Offload: what stays on the device shrinks as the formula says; faults name the path; resume works."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch.distributed as dist

import shardwise
from shardwise.zero import formula_bytes, measured_bytes
from tests.harness import RankFailure, run_distributed
from tests.parity import ds_config, make_model, micro_batch, param_groups


def _engine(zero, precision=None):
    model = make_model()
    shardwise.zero.register_external_parameter(model, model.embed.weight)
    extra = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}} if precision == "bf16" else {}
    config = ds_config(2, 1, zero_optimization=zero, **extra)
    engine, *_ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=config)
    return engine


def _train(engine, start, steps):
    losses = []
    for step in range(start, start + steps):
        loss = engine(*micro_batch(step, 0, dist.get_rank(), 2, 1, dist.get_world_size()))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _memory():
    out = {}
    for name, zero in {"stage2": {"stage": 2}, "stage2+cpu": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                       "stage3+cpu+cpu": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                          "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}.items():
        engine = _engine(zero, "bf16")
        _train(engine, 0, 2)
        psi = sum(p.numel() for p in make_model().parameters() if p.requires_grad)
        out[name] = (measured_bytes(engine.strategy), psi)
    return out


def test_device_side_model_states_shrink_with_offload():
    results = run_distributed(_memory, 2)[0]
    (plain, psi), (cpu, _), (both, _) = results["stage2"], results["stage2+cpu"], results["stage3+cpu+cpu"]
    expected = formula_bytes(psi, 2, 2, 2, 2, 12)
    pad = 0.01 * expected.total
    # Stage 2 + CPU offload keeps only the 16-bit parameters and the gradient partitions on the device.
    assert abs(cpu.device - (expected.params + expected.grads)) <= pad
    assert abs(cpu.host - expected.optimizer) <= pad
    assert abs(plain.device - expected.total) <= pad and plain.host == 0
    # Stage 3 with parameters offloaded too: only the gradient partitions stay (2Ψ/N).
    assert abs(both.device - 2 * psi / 2) <= pad


def _faulty(zero):
    _engine(zero)


def test_unwritable_nvme_path_is_named(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    zero = {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": str(locked / "swap")}}
    if os.geteuid() == 0:  # root writes anywhere: use a path under a regular file instead
        (tmp_path / "file").write_text("x")
        zero["offload_optimizer"]["nvme_path"] = str(tmp_path / "file" / "swap")
    with pytest.raises(RankFailure, match=r"offload_optimizer.nvme_path: cannot write to '.*swap'"):
        run_distributed(_faulty, 1, zero)


def test_full_disk_fails_before_training(tmp_path):
    mount = tmp_path / "tiny"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root and mount permission)")
    try:
        model_bytes = 4 * sum(p.numel() for p in make_model().parameters())
        assert model_bytes > 16 * 1024  # the fp32 masters alone do not fit in 16 KiB
        zero = {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": str(mount)}}
        with pytest.raises(RankFailure, match=r"NVMe offload: cannot allocate .* MiB for '.*tiny/.*': No space left on device"):
            run_distributed(_faulty, 1, zero)
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def _deleted_swap(root):
    engine = _engine({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": root}})
    _train(engine, 0, 1)
    for swap in engine.strategy.offload.swapper.dir.glob("master0.swp"):
        swap.unlink()
    _train(engine, 1, 1)


def test_deleted_swap_file_is_named(tmp_path):
    with pytest.raises(RankFailure, match=r"swap file '.*master0.swp' is missing \(deleted while training\?\)"):
        run_distributed(_deleted_swap, 1, str(tmp_path))


def _resume(root, nvme, phase):
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
            "offload_param": {"device": "cpu"}}
    engine = _engine(zero)
    if phase == "save":
        _train(engine, 0, 3)
        engine.save_checkpoint(root)
        losses = _train(engine, 3, 3)
    else:
        engine.load_checkpoint(root)
        losses = _train(engine, 3, 3)
    engine.destroy()
    return losses


def test_resume_with_offload_continues_exactly(tmp_path):
    (tmp_path / "swap").mkdir()
    saved = run_distributed(_resume, 2, str(tmp_path / "ckpt"), str(tmp_path / "swap"), "save")[0]
    resumed = run_distributed(_resume, 2, str(tmp_path / "ckpt"), str(tmp_path / "swap"), "load")[0]
    assert saved == resumed
