"""A nan/inf loss in fp32 or bf16: the step is skipped on every rank (even when one rank alone sees it),
counted and reported, or raised with `"nonfinite_grads": "raise"`; at ZeRO stages 0-3, world size 2.

DeepSpeed 0.19.8, measured with `DS_ACCELERATOR=cpu PYTHONPATH=src:. /work/main/.dsvenv/bin/python -m
tests.distributed.test_deepspeed_parity_backward`: a nan loss in fp32 is applied silently at stage 0 (every
weight becomes nan) and skipped at stages 1-3 (skipped_steps 1, weights unchanged); in bf16 it is skipped at
every stage. Before this change shardwise applied it at every stage and precision: all weights became nan.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.distributed as dist

import shardwise
from shardwise.config import ConfigError
from shardwise.config.parse import parse_config
from shardwise.runtime.step import NonFiniteGradientError
from tests.harness import run_distributed
from tests.logs import LogMessages
from tests.parity import (
    assert_close_run,
    ds_config,
    global_batch,
    make_model,
    micro_batch,
    param_groups,
)

STAGES = (0, 1, 2, 3)
STEPS, BAD_STEP, MICRO = 5, 2, 2


def _params(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}


def _train(engine, steps: int) -> list[tuple[float, bool, bool, int]]:
    """Per step: the global mean loss, whether the weights moved, whether they are all finite, and the
    all-reduces step() issued. Rank 1 alone multiplies its loss at BAD_STEP by nan."""
    rank = dist.get_rank()
    record = []
    for step in range(steps):
        before = _params(engine)
        loss = engine(*micro_batch(step, 0, rank, MICRO, 1, 2))
        engine.backward(loss * math.nan if step == BAD_STEP and rank == 1 else loss)
        calls = engine.comm.stats.calls("all_reduce")
        engine.step()
        calls = engine.comm.stats.calls("all_reduce") - calls
        after = _params(engine)
        total = loss.detach().float().reshape(1)
        dist.all_reduce(total)
        moved = any(not torch.equal(before[k], after[k]) for k in before)
        record.append((total.item() / 2, moved, all(bool(v.isfinite().all()) for v in after.values()), calls))
    return record


def _skip_sweep():
    handler = LogMessages()
    logging.getLogger("shardwise.runtime.engine").addHandler(handler)
    out = {}
    for precision in ("fp32", "bf16"):
        for stage in STAGES:
            model = make_model()
            extra = {"bf16": {"enabled": True}} if precision == "bf16" else {}
            config = ds_config(MICRO, 1, zero_optimization={"stage": stage}, **extra)
            engine, *_ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=config)
            record = _train(engine, STEPS)
            out[precision, stage] = (record, engine.skipped_steps, engine.global_steps, _params(engine))
    return out, handler.messages


def _oracle_skipping(skip: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """tests/parity.py's oracle with step `skip`'s update left out."""
    model = make_model()
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2, betas=(0.9, 0.99), eps=1e-8)
    losses = []
    for step in range(STEPS):
        loss = model(*global_batch(step, MICRO * 2))
        loss.backward()
        if step != skip:
            opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_nonfinite_gradient_skips_the_step_on_every_rank_and_says_so():
    ref_losses, ref_params = _oracle_skipping(BAD_STEP)
    (results, messages), _ = run_distributed(_skip_sweep, 2)
    for (precision, stage), (record, skipped, steps, params) in results.items():
        where = f"{precision} stage {stage}"
        assert [moved for _, moved, _, _ in record] == [True, True, False, True, True], where
        assert all(finite for _, _, finite, _ in record), where
        assert skipped == 1 and steps == STEPS, where
        # The check reads the norm the step computes anyway: no collective is added to agree on skipping.
        assert record[BAD_STEP][3] == record[BAD_STEP + 1][3], where
        if precision == "fp32":
            good = [i for i in range(STEPS) if i != BAD_STEP]
            assert_close_run([record[i][0] for i in good], params, [ref_losses[i] for i in good], ref_params, 1e-5)
    expected = ('step 3: the gradient norm is nan (a nan/inf loss or gradient); the update was skipped '
                '(skipped_steps = 1). Set "nonfinite_grads": "raise" to stop instead.')
    assert messages.count(expected) == 2 * len(STAGES), messages


def _raise_sweep():
    out = {}
    for stage in STAGES:
        model = make_model()
        config = ds_config(MICRO, 1, zero_optimization={"stage": stage}, nonfinite_grads="raise")
        engine, *_ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=config)
        _train(engine, BAD_STEP)
        before = _params(engine)
        loss = engine(*micro_batch(BAD_STEP, 0, dist.get_rank(), MICRO, 1, 2))
        engine.backward(loss * math.inf)
        with pytest.raises(NonFiniteGradientError) as error:
            engine.step()
        after = _params(engine)
        out[stage] = (str(error.value), all(torch.equal(before[k], after[k]) for k in before), engine.skipped_steps)
    return out


def test_raise_stops_with_the_step_and_norm_and_leaves_the_weights():
    for stage, (message, unchanged, skipped) in run_distributed(_raise_sweep, 2)[0].items():
        assert message == ('nonfinite_grads = "raise": step 3: the gradient norm is nan (a nan/inf loss or gradient); '
                           'the update was skipped (skipped_steps = 1). Find where the loss becomes non-finite, or set '
                           '"nonfinite_grads": "skip" to go on.'), stage
        assert unchanged and skipped == 1, stage


def test_raise_is_refused_with_fp16_whose_loss_scaler_owns_overflows():
    with pytest.raises(ConfigError, match=r'nonfinite_grads: "raise" applies to fp32 and bf16 runs; got "raise" '
                                          r"with fp16.enabled\. .*remove nonfinite_grads"):
        parse_config({"train_batch_size": 2, "nonfinite_grads": "raise", "fp16": {"enabled": True}})
    with pytest.raises(ConfigError, match=r"nonfinite_grads: must be one of skip, raise; got 'rase'\. Did you mean 'raise'\?"):
        parse_config({"train_batch_size": 2, "nonfinite_grads": "rase"})
