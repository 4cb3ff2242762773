"""One data-parallel rank ([Note: a data-parallel group of one] in zero/stage1_2.py): every stage keeps whole
gradient buckets and issues no collective, for gradients or parameters (stage 3 reads its whole slices in place:
[Note: a unit of one] in zero/stage3/unit.py); they train like the torch oracle,
gradient accumulation, clipping and two backwards per micro-step included (a GAN's two engines alone:
test_backward_semantics.py)."""

from __future__ import annotations

import pytest
import torch

import shardwise
from tests.harness import run_distributed
from tests.parity import assert_close_run, ds_config, engine_run, global_batch, make_model, oracle, param_groups

STEPS, MICRO = 6, 4
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")


def _alone(config):
    losses, params, engine = engine_run(config, STEPS)
    calls = {op: engine.comm.stats.calls(op) for op in COLLECTIVES}
    return losses, params, calls, [b.partitioned for b in engine.strategy.buckets.buckets]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("accum", [1, 3])
def test_alone_trains_like_the_oracle_with_whole_buckets_and_no_collective(stage, accum):
    ref_losses, ref_params = oracle(STEPS, MICRO * accum, lr=0.1, clip=1.0, optimizer="sgd")
    config = ds_config(MICRO, accum, clip=1.0, lr=0.1, optimizer="sgd", zero_optimization={"stage": stage})
    losses, params, calls, partitioned = run_distributed(_alone, 1, config)[0]
    assert_close_run(losses, params, ref_losses, ref_params, rtol=1e-5)
    assert calls == dict.fromkeys(COLLECTIVES, 0), calls
    assert partitioned and not any(partitioned)


def _two_backwards(stage):
    model = make_model()
    config = ds_config(MICRO, 2, optimizer="sgd", lr=0.1, zero_optimization={"stage": stage})
    engine, *_ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=config)
    for step in range(3):
        tokens, labels = global_batch(step, MICRO * 2)
        for micro in range(2):  # two micro-steps, each with a second backward through the output layer
            engine.backward(engine(tokens[micro * MICRO : (micro + 1) * MICRO], labels[micro * MICRO : (micro + 1) * MICRO]))
            engine.backward(0.5 * engine.module.out.weight.square().sum())
            engine.step()
    return {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}


def _two_backwards_oracle():
    model = make_model()
    opt = torch.optim.SGD(param_groups(model), lr=0.1, momentum=0.9)
    for step in range(3):
        tokens, labels = global_batch(step, MICRO * 2)
        for micro in range(2):
            # engine.backward divides each loss by gradient_accumulation_steps
            (model(tokens[micro * MICRO : (micro + 1) * MICRO], labels[micro * MICRO : (micro + 1) * MICRO]) / 2).backward()
            (0.5 * model.out.weight.square().sum() / 2).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_two_backwards_per_micro_step_alone_sum_their_gradients(stage):
    ref = _two_backwards_oracle()
    params = run_distributed(_two_backwards, 1, stage)[0]
    for name, value in ref.items():
        torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"stage {stage} {name}: {m}")
