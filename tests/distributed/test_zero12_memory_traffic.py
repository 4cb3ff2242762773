"""ZeRO-1/2 hold the memory the formula says, move the same bytes as data parallel, and keep
mixed precision and overflow handling intact."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import shardwise
from shardwise.zero import formula_bytes, measured_bytes
from tests.harness import run_distributed
from tests.parity import ds_config, engine_run, make_model, micro_batch, oracle, param_groups

STEPS = 6


def _memory_and_traffic(world):
    out = {}
    for stage in (0, 1, 2):
        for precision in ("fp32", "bf16"):
            extra = {} if precision == "fp32" else {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}}
            config = ds_config(2, 1, zero_optimization={"stage": stage, "reduce_bucket_size": 1000}, **extra)
            _, _, engine = engine_run(config, STEPS)
            stats = engine.comm.stats
            psi = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
            out[(stage, precision)] = (measured_bytes(engine.strategy), psi, {
                "all_reduce": stats.elements("all_reduce", "data"),
                "reduce_scatter": stats.elements("reduce_scatter", "data"),
                "all_gather": stats.elements("all_gather", "data"),
            })
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_model_states_match_the_formula_and_traffic_matches_data_parallel(world):
    results = run_distributed(_memory_and_traffic, world, world)[0]
    for (stage, precision), (measured, psi, traffic) in results.items():
        if stage > 0:
            width = 4 if precision == "fp32" else 2
            expected = formula_bytes(psi, world, stage, width, width, 8 if precision == "fp32" else 12)
            for part in ("params", "grads", "optimizer"):
                got, want = getattr(measured, part), getattr(expected, part)
                # Padding: at most world-1 elements per bucket (a handful of buckets here).
                assert abs(got - want) <= 0.01 * want, f"stage {stage} {precision} {part}: {got} vs {want}"
        # Ring all-reduce moves 2x its size; reduce-scatter + all-gather move their sizes once each.
        wire = 2 * traffic["all_reduce"] + traffic["reduce_scatter"] + traffic["all_gather"]
        assert abs(wire - 2 * psi * STEPS) <= 2 * STEPS * (world - 1) * 8 + STEPS, (stage, precision, traffic, psi)
    # stage 2 shards what stage 1 keeps whole
    assert results[(2, "fp32")][0].grads < results[(1, "fp32")][0].grads / (world - 0.5)


def _mixed(stage, dtype):
    # A modest initial fp16 scale: the default 2**16 overflows the first steps, which are then
    # (correctly) skipped and the run no longer lines up with the oracle step for step.
    precision = {"enabled": True, "initial_scale_power": 8} if dtype == "fp16" else {"enabled": True}
    config = ds_config(2, 2, zero_optimization={"stage": stage}, **{dtype: precision})
    losses, params, engine = engine_run(config, 20)
    assert engine.skipped_steps == 0
    return losses, params


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mixed_precision_within_bound(stage, dtype):
    ref_losses, _ = oracle(20, 8)
    (losses, _), _ = run_distributed(_mixed, 2, stage, dtype)
    # 16-bit activations round at ~4e-3 (bf16) / ~5e-4 (fp16) relative: the losses stay within 2%.
    assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) < 0.02
    assert losses[-1] < losses[0] - 0.3


def _overflow(stage):
    model = make_model()
    config = ds_config(2, 1, fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1},
                       zero_optimization={"stage": stage})
    engine, *_ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=config)
    applied = []
    for step in range(4):
        hook = None
        if step == 2 and dist.get_rank() == 1:  # only rank 1's local gradient overflows
            hook = engine.module.hidden.weight.register_hook(lambda g: g * math.inf)
        engine.backward(engine(*micro_batch(step, 0, dist.get_rank(), 2, 1, 2)))
        engine.step()
        if hook:
            hook.remove()
        applied.append(engine.was_step_applied())
    return applied, engine.loss_scale, all(torch.isfinite(p).all().item() for p in engine.module.parameters())


@pytest.mark.parametrize("stage", [1, 2])
def test_injected_overflow_skips_everywhere(stage):
    for applied, scale, finite in run_distributed(_overflow, 2, stage):
        assert applied == [True, True, False, True] and scale == 128 and finite


def test_no_sync_is_refused_at_stage_2():
    def run():
        model = make_model()
        engine, *_ = shardwise.initialize(model=model, config=ds_config(2, 1, zero_optimization={"stage": 2}))
        with engine.no_sync():
            pass

    with pytest.raises(Exception, match="ZeRO stage 2 reduces gradients into partitions"):
        run_distributed(run, 1)
