"""Offload: what stays on the device shrinks as the formula says; faults name the path; resume works."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
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


def test_model_state_bytes_follow_the_formula_with_offload():
    """How many bytes each kind of model state takes (counted from the tensors' storages); where they live is
    read from the tensors themselves in test_offloaded_bytes_live_where_the_config_says."""
    results = run_distributed(_memory, 2)[0]
    (plain, psi), (cpu, _), (both, _) = results["stage2"], results["stage2+cpu"], results["stage3+cpu+cpu"]
    pad = 0.01 * formula_bytes(psi, 2, 2, 2, 2, 12).total
    # bf16 parameters and gradients (grad_accum_dtype bf16), fp32 masters + Adam moments: 12 bytes per element.
    for got, stage in ((plain, 2), (cpu, 2), (both, 3)):
        expected = formula_bytes(psi, 2, stage, 2, 2, 12)
        for kind in ("params", "grads", "optimizer"):
            assert abs(getattr(got, kind) - getattr(expected, kind)) <= pad, (stage, kind, got, expected)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The address range of the bytes `t` covers."""
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def _overlaps(t: torch.Tensor, others: list[torch.Tensor]) -> bool:
    lo, hi = _span(t)
    return any(lo < o_hi and o_lo < hi for o_lo, o_hi in map(_span, others) if o_hi > o_lo)


def _where(t: torch.Tensor, compute: list[torch.Tensor]) -> dict:
    """Where one tensor's bytes are, read from the tensor itself."""
    return {"numel": t.numel(), "device": t.device.type, "pinned": t.is_pinned(), "shares_compute": _overlaps(t, compute),
            "bytes": t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""}


def _placement(zero, nvme):
    """After 2 fp32 steps: each optimizer-side tensor (fp32 masters, Adam moments) and, at stage 3, each parameter
    slice kept between uses; and this rank's swap files' contents."""
    engine = _engine(zero, precision=None)
    _train(engine, 0, 2)
    compute = [p for p in engine.module.parameters() if p.numel()]  # stage 3: none are whole between forwards
    masters = [p for g in engine.optimizer.param_groups for p in g["params"]]
    states = [v for m in masters for v in engine.optimizer.state.get(m, {}).values() if v.dim() > 0]
    # Stage 3's parameter slices between uses (what profiling.memory.measured_bytes reads too).
    units = getattr(engine.strategy, "units", [])
    out = {"masters": [_where(t, compute) for t in masters], "states": [_where(t, compute) for t in states],
           "slices": [{**_where(u.shard, masters), "trainable": u.master is not None} for u in units],
           "swap": [f.read_bytes() for f in sorted(Path(nvme).glob(f"*rank{dist.get_rank()}-*/*"))]}
    engine.destroy()
    return out


PLACEMENTS = {
    "stage2": {"stage": 2},
    "stage2+cpu": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    "stage2+nvme": {"stage": 2, "offload_optimizer": {"device": "nvme"}},
    "stage3": {"stage": 3},
    "stage3+param-cpu": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}},
    "stage3+param-nvme": {"stage": 3, "offload_param": {"device": "nvme"}},
}


def _placements(nvme):
    out = {}
    for name, zero in PLACEMENTS.items():
        zero = {**zero, **({"stage3_param_persistence_threshold": 0} if zero["stage"] == 3 else {})}
        for key in ("offload_optimizer", "offload_param"):
            if zero.get(key, {}).get("device") == "nvme":
                zero[key] = {**zero[key], "nvme_path": nvme}
        out[name] = _placement(zero, nvme)
    return out


def _stored_in(data: bytes, files: list[bytes]) -> bool:
    """Whether a swap file begins with these bytes (a swap file is page-padded)."""
    return any(f.startswith(data) for f in files)


def test_offloaded_bytes_live_where_the_config_says(tmp_path):
    # fp32 on CPU: "on the device" means inside the buffers the module computes with, so an offloaded copy is
    # one that shares no bytes with them. Pinned host memory needs CUDA; without it nothing is pinned.
    pinned = torch.cuda.is_available()
    for rank in run_distributed(_placements, 2, str(tmp_path)):
        plain, cpu, nvme = rank["stage2"], rank["stage2+cpu"], rank["stage2+nvme"]
        # Stage 2 on the device: each fp32 master is this rank's slice of the very parameters the module uses.
        assert plain["masters"] and all(m["shares_compute"] for m in plain["masters"])
        # offload_optimizer cpu: masters and Adam moments are separate host copies (pinned where CUDA is).
        assert [m["numel"] for m in cpu["masters"]] == [m["numel"] for m in plain["masters"]]
        assert len(cpu["states"]) == 2 * len(cpu["masters"])  # exp_avg, exp_avg_sq
        for t in cpu["masters"] + cpu["states"]:
            assert (t["device"], t["pinned"], t["shares_compute"]) == ("cpu", pinned, False), t
        # offload_optimizer nvme: between steps no master or moment byte is in memory; the swap files hold them
        # (the same values as the CPU-offloaded run's: offloading changes where bytes live, not the numbers).
        assert all(t["numel"] == 0 for t in nvme["masters"] + nvme["states"])
        assert all(_stored_in(t["bytes"], nvme["swap"]) for t in cpu["masters"] + cpu["states"])
        assert not plain["swap"] and not cpu["swap"] and not rank["stage3"]["swap"]
        # Stage 3: without offload_param, the kept slice is the fp32 master itself; with cpu, a separate host copy.
        s3, s3cpu, s3nvme = rank["stage3"], rank["stage3+param-cpu"], rank["stage3+param-nvme"]
        assert s3["slices"] and all(t["shares_compute"] == t["trainable"] for t in s3["slices"])  # the frozen unit: no master
        for t in s3cpu["slices"]:
            assert (t["device"], t["pinned"], t["shares_compute"]) == ("cpu", pinned, False), t
        # offload_param nvme: no slice resident; each one's values (fp32: the master's) are in a swap file.
        assert len(s3nvme["slices"]) == len(s3["slices"]) and all(t["numel"] == 0 for t in s3nvme["slices"])
        assert all(_stored_in(t["bytes"], s3nvme["swap"]) for t in s3["masters"])


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
