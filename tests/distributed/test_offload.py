"""ZeRO-Offload / ZeRO-Infinity: optimizer state (stages 1-3) and parameters (stage 3) in host memory
or on disk give the same numbers as keeping them on the device."""

from __future__ import annotations

import torch
import torch.distributed as dist

import shardwise
from tests.harness import run_distributed
from tests.parity import ds_config, full_state_dict, make_model, micro_batch, param_groups

STEPS = 10


def _zero(stage, optimizer="none", params="none", nvme=None):
    zero = {"stage": stage, "sub_group_size": 1500}  # several sub-groups: the pipeline is exercised
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0)
    if optimizer != "none":
        zero["offload_optimizer"] = {"device": optimizer, **({"nvme_path": nvme} if optimizer == "nvme" else {})}
    if params != "none":
        zero["offload_param"] = {"device": params, **({"nvme_path": nvme} if params == "nvme" else {})}
    return zero


def _run(zero, precision="fp32", steps=STEPS, reduce_bucket=1000):
    model = make_model()
    shardwise.zero.register_external_parameter(model, model.embed.weight)
    extra = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    config = ds_config(2, 2, lr=0.1, optimizer="adamw", clip=2.0,
                       zero_optimization={**zero, "reduce_bucket_size": reduce_bucket}, **extra)
    engine, *_ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=config)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(steps):
        for m in range(2):
            loss = engine(*micro_batch(step, m, rank, 2, 2, world))
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    return losses, {k: v.float() for k, v in full_state_dict(engine).items()}, engine


def _sweep(cases, nvme):
    out = []
    for stage, optimizer, params, precision in cases:
        reference = _run(_zero(stage), precision)
        offloaded = _run(_zero(stage, optimizer, params, nvme), precision)
        offloaded[2].destroy()  # removes its swap files
        out.append((reference[:2], offloaded[:2]))
    return out


CASES = [(1, "cpu", "none", "fp32"), (2, "cpu", "none", "fp32"), (3, "cpu", "none", "fp32"),
         (1, "nvme", "none", "fp32"), (2, "nvme", "none", "fp32"), (3, "nvme", "none", "fp32"),
         (3, "none", "cpu", "fp32"), (3, "none", "nvme", "fp32"), (3, "cpu", "cpu", "fp32"),
         (2, "cpu", "none", "bf16"), (3, "nvme", "nvme", "bf16")]


def test_offload_changes_where_bytes_live_not_the_numbers(tmp_path):
    results = run_distributed(_sweep, 2, CASES, str(tmp_path), timeout=400)[0]
    for case, ((ref_losses, ref_params), (losses, params)) in zip(CASES, results):
        # fp32: the same arithmetic on the same values; bf16: the same up to where a cast happens.
        tol = 1e-6 if case[3] == "fp32" else 1e-2
        for a, b in zip(losses, ref_losses):
            assert abs(a - b) <= tol * abs(b), (case, losses, ref_losses)
        for name in ref_params:
            torch.testing.assert_close(params[name], ref_params[name], rtol=tol, atol=tol, msg=lambda m: f"{case} {name}: {m}")
    assert not list(tmp_path.iterdir())  # no swap file is left behind
