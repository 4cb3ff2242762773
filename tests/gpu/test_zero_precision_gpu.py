"""ZeRO stages 0-3 at world 1 on the device (CUDA + NCCL in `make test-gpu`, CPU + gloo in CI) against the
single-process oracle: fp32 to 1e-5, bf16 and fp16 to stated bounds; and fp16's dynamic loss scale meeting a
real overflow (gradients past fp16's range under a huge initial scale, nothing injected): those steps are
skipped, the scale halves at each, and the parameters move only on applied steps."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.gpu.device import DEVICE, device_of, on_device
from tests.parity import assert_close_run, ds_config, engine_run, oracle

STEPS = 8
MICRO, ACCUM = 2, 2
INITIAL_SCALE_POWER = 24


FP32 = {stage: ds_config(MICRO, ACCUM, clip=1.0, zero_optimization={"stage": stage}) for stage in (0, 1, 2, 3)}
HALF = {(stage, dtype): ds_config(MICRO, ACCUM, clip=1.0, zero_optimization={"stage": stage},
                                  **{dtype: {"enabled": True} if dtype == "bf16" else {"enabled": True, "initial_scale_power": 8}})
        for stage in (0, 1, 2, 3) for dtype in ("bf16", "fp16")}
OVERFLOW_STAGES = (0, 2, 3)


def _sweep() -> dict[Any, Any]:
    """Every run of this module in one process (on CUDA a process start costs seconds of the suite's budget)."""
    results: dict[Any, Any] = {}
    for key, config in [*FP32.items(), *HALF.items()]:
        losses, params, engine = engine_run(config, STEPS)
        results[key] = (losses, params, device_of(engine), {p.dtype for p in engine.module.parameters()})
        engine.destroy()
    for stage in OVERFLOW_STAGES:
        results["overflow", stage] = _real_overflow(stage)
    results["backend"] = torch.distributed.get_backend()
    return results


@pytest.fixture(scope="module")
def runs() -> dict[Any, Any]:
    return on_device(_sweep, timeout=600)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp32_zero_stage_matches_the_oracle(stage: int, runs: dict[Any, Any]) -> None:
    losses, params, device, _ = runs[stage]
    assert device == DEVICE and runs["backend"] == ("nccl" if DEVICE == "cuda" else "gloo")
    ref_losses, ref_params = oracle(STEPS, MICRO * ACCUM, clip=1.0)
    assert_close_run(losses, params, ref_losses, ref_params, rtol=1e-5)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_precision_zero_stage_trains_close_to_the_oracle(stage: int, dtype: str, runs: dict[Any, Any]) -> None:
    losses, _, device, dtypes = runs[stage, dtype]
    assert device == DEVICE and dtypes == {torch.bfloat16 if dtype == "bf16" else torch.float16}
    ref_losses, _ = oracle(STEPS, MICRO * ACCUM, clip=1.0)
    # bf16 keeps 8 mantissa bits, fp16 11: the forward's activations round at ~4e-3 (bf16) and ~5e-4 (fp16)
    # relative, and the masters stay fp32, so the losses stay within 2% (bf16) and 0.5% (fp16) of the oracle's.
    bound = 0.02 if dtype == "bf16" else 0.005
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= bound * b, f"step {step}: {dtype} loss {a} vs oracle {b}"
    assert losses[-1] < losses[0]


def _real_overflow(stage: int) -> list[tuple[bool, bool, float]]:
    import shardwise
    from tests.parity import make_model, micro_batch, param_groups

    # 2**24 times a cross-entropy gradient is far past fp16's 65504: the first backwards overflow for real.
    config = ds_config(MICRO, 1, zero_optimization={"stage": stage},
                       fp16={"enabled": True, "initial_scale_power": INITIAL_SCALE_POWER, "hysteresis": 1, "loss_scale_window": 1000})
    model = make_model()
    engine, *_ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=config)
    record = []
    for step in range(24):
        with shardwise.zero.GatheredParameters(list(engine.module.parameters())):
            snapshot = [p.detach().clone() for p in engine.module.parameters()]
        loss = engine(*(t.to(engine.device) for t in micro_batch(step, 0, 0, MICRO, 1, 1)))
        engine.backward(loss)
        engine.step()
        with shardwise.zero.GatheredParameters(list(engine.module.parameters())):
            moved = any(not torch.equal(a, p) for a, p in zip(snapshot, engine.module.parameters()))
        record.append((engine.was_step_applied(), moved, float(engine.loss_scale)))
    return record


@pytest.mark.parametrize("stage", OVERFLOW_STAGES)
def test_fp16_real_overflow_skips_steps_and_lowers_the_scale(stage: int, runs: dict[Any, Any]) -> None:
    record = runs["overflow", stage]
    applied = [r[0] for r in record]
    assert not applied[0], "2**24 times the gradient fits fp16: the overflow this test needs never happened"
    assert [r[1] for r in record] == applied, "parameters must move on applied steps and only on them"
    scales = [2.0**INITIAL_SCALE_POWER] + [r[2] for r in record]
    for step, ok in enumerate(applied):  # each overflow halves the scale; an applied step keeps it (window 1000)
        assert scales[step + 1] == (scales[step] if ok else scales[step] / 2), (step, scales[: step + 2])
    assert sum(applied) >= 8, f"the scale never settled: {applied}"
