"""Engine behaviour at world size 2: precision, overflow skipping, accumulation traffic, no_sync, timeouts,
and the messages that misuse gets."""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist

import shardwise
from tests.harness import RankFailure, run_distributed
from tests.parity import (assert_close_run, ds_config, engine_run, full_state_dict, make_model, micro_batch, oracle,
                          param_groups)

STEPS = 20


def _bf16_run():
    losses, params, engine = engine_run(ds_config(2, 2, bf16={"enabled": True}), STEPS)
    dtypes = {p.dtype for p in engine.module.parameters()}
    return losses, params, dtypes


def test_bf16_trains_close_to_fp32_oracle():
    ref_losses, ref_params = oracle(STEPS, 8)
    (losses, params, dtypes), _ = run_distributed(_bf16_run, 2)
    assert dtypes == {torch.bfloat16}
    assert losses[-1] < losses[0] - 0.3
    # bf16 keeps 8 mantissa bits: activations round at ~4e-3 relative, so losses stay within 2%.
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 0.02 * b


def _overflow_run(bad_step):
    model = make_model()
    config = ds_config(2, 1, fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1})
    engine, *_ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=config)
    record = []
    for step in range(6):
        hook = None
        if step == bad_step and dist.get_rank() == 1:  # only one rank sees the overflow
            hook = engine.module.hidden.weight.register_hook(lambda g: g * math.inf)
        before = engine.module.out.weight.detach().clone()
        loss = engine(*micro_batch(step, 0, dist.get_rank(), 2, 1, 2))
        engine.backward(loss)
        engine.step()
        if hook:
            hook.remove()
        changed = not torch.equal(before, engine.module.out.weight)
        record.append((engine.was_step_applied(), changed, engine.loss_scale))
    return record, engine.skipped_steps, engine.global_steps


def test_fp16_overflow_skips_that_step_on_every_rank():
    for record, skipped, steps in run_distributed(_overflow_run, 2, 3):
        applied = [r[0] for r in record]
        assert applied == [True, True, True, False, True, True]
        assert [r[1] for r in record] == applied  # parameters move exactly on applied steps
        assert record[2][2] == 256 and record[3][2] == 128  # scale halved at the overflow
        assert skipped == 1 and steps == 6


def _traffic_run():
    config = ds_config(2, 2, zero_optimization={"reduce_bucket_size": 600})
    losses, params, engine = engine_run(config, STEPS)
    buckets = len(engine.strategy.buckets.buckets)
    trainable = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    return losses, params, buckets, engine.comm.stats.calls("all_reduce", "data"), engine.comm.stats.elements("all_reduce"), trainable


def test_accumulation_communicates_only_at_the_boundary():
    ref_losses, ref_params = oracle(STEPS, 8)
    for losses, params, buckets, calls, elements, trainable in run_distributed(_traffic_run, 2):
        assert_close_run(losses, params, ref_losses, ref_params, rtol=1e-5)
        assert buckets > 3
        assert calls == STEPS * buckets  # one all-reduce per bucket per optimizer step, none per micro-step
        assert elements == STEPS * trainable  # stage 0 moves each gradient element once per step


def _no_sync_run():
    model = make_model()
    engine, *_ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=ds_config(2, 2))
    rank = dist.get_rank()
    losses = []
    for step in range(5):
        with engine.no_sync():
            engine.backward(engine(*micro_batch(step, 0, rank, 2, 2, 2)))
            if step == 0:
                try:
                    engine.step()
                except RuntimeError as e:
                    assert "inside engine.no_sync()" in str(e)
        calls = engine.comm.stats.calls("all_reduce")
        loss = engine(*micro_batch(step, 1, rank, 2, 2, 2))
        engine.set_gradient_accumulation_boundary(True)
        engine.backward(loss)
        engine.step()
        losses.append(calls)
    return full_state_dict(engine), losses


def test_no_sync_accumulates_locally_then_reduces():
    _, ref_params = oracle(5, 8)
    (params, calls_before_boundary), _ = run_distributed(_no_sync_run, 2)
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-5)
    assert calls_before_boundary == [0, 1, 2, 3, 4]  # nothing was sent inside no_sync


def _slow_rank_run():
    model = make_model()
    config = ds_config(2, 1, collective_timeout_s=1.5)
    engine, *_ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=config)
    if dist.get_rank() == 1:
        time.sleep(6)
    engine.backward(engine(*micro_batch(0, 0, dist.get_rank(), 2, 1, 2)))


def test_collective_timeout_names_rank_op_group_and_shape():
    with pytest.raises(RankFailure, match=r"CollectiveTimeout: \[rank 0/2, data group\] all_reduce of \(\d+,\) float32"):
        run_distributed(_slow_rank_run, 2, timeout=60)


def _misuse_messages():
    def engine_with(**extra):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4))
        engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=ds_config(2, 1, **extra))
        return engine

    messages = {}
    for name, extra, x in (("float64 input", {}, torch.randn(2, 3, dtype=torch.float64)),
                           ("fp32 input, bf16", {"bf16": {"enabled": True}}, torch.randn(2, 3)),
                           ("fp32 input, fp16", {"fp16": {"enabled": True}}, torch.randn(2, 3))):
        with pytest.raises(TypeError) as error:
            engine_with(**extra)(x)
        messages[name] = str(error.value)
    engine = engine_with()
    with pytest.raises(TypeError) as error:
        engine.backward(1.5)
    messages["python number"] = str(error.value)
    with torch.no_grad():
        loss = engine(torch.randn(2, 3)).sum()
    with pytest.raises(ValueError) as error:
        engine.backward(loss)
    messages["no_grad loss"] = str(error.value)
    return messages


def test_misuse_names_the_problem_and_the_fix():
    messages = run_distributed(_misuse_messages, 2)[0]
    assert messages["float64 input"] == (
        "engine(...) argument 0: floating-point inputs must be in the dtype the model computes in, torch.float32; got "
        "torch.float64. Cast the inputs (x.to(torch.float32)). (torch: mat1 and mat2 must have the same dtype, but got "
        "Double and Float)")
    assert messages["fp32 input, bf16"].startswith(
        "engine(...) argument 0: floating-point inputs must be in the dtype the model computes in, torch.bfloat16; "
        "got torch.float32. Cast the inputs (x.to(torch.bfloat16)). (torch: ")
    assert ('torch.float16; got torch.float32. Cast the inputs (x.to(torch.float16)), or set "fp16": {"auto_cast": '
            'true} to have the engine cast floating-point inputs.') in messages["fp32 input, fp16"]
    assert messages["python number"] == (
        "engine.backward(loss): loss must be the scalar tensor the model computed; got float 1.5. Pass the loss "
        "tensor itself (not loss.item() or a number).")
    assert messages["no_grad loss"].startswith(
        "engine.backward(loss): the loss must have a gradient history (requires_grad, a grad_fn); got a tensor "
        "without one: it was computed under torch.no_grad() or torch.inference_mode()")
