"""Which gradients an engine steps on, at world size 2 (the GAN alone too) and ZeRO stages 0-3, against the torch oracle:
a direct `loss.backward()` (then `engine.step()`), two engines in one script (a GAN), and `step()`
without any backward. The rule is zero/grad_buckets.py's [Note: whose gradient is it].

DeepSpeed 0.19.8's behaviour in each case was measured with (CPU, gloo, 2 ranks):

    DS_ACCELERATOR=cpu PYTHONPATH=src:. /work/main/.dsvenv/bin/python -m tests.distributed.test_deepspeed_parity_backward

and is written next to each test; tests/distributed/test_deepspeed_parity_backward.py checks shardwise
against it where DeepSpeed completes.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

import shardwise
from tests.gan import gan_oracle, gan_run
from tests.harness import run_distributed
from tests.logs import LogMessages
from tests.parity import (
    assert_close_run,
    ds_config,
    make_model,
    micro_batch,
    oracle,
    param_groups,
    train_steps,
)

STAGES = (0, 1, 2, 3)
STEPS, MICRO, ACCUM = 4, 2, 2


def _direct_steps(engine, steps: int) -> list[float]:
    """`train_steps` with `loss.backward()` where the script would call `engine.backward(loss)`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(steps):
        total = torch.zeros(())
        for m in range(ACCUM):
            loss = engine(*micro_batch(step, m, rank, MICRO, ACCUM, world))
            loss.backward()
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)
        losses.append(total.item() / (ACCUM * world))
    return losses


def _direct_sweep():
    out = {}
    for stage in STAGES:
        model = make_model()
        config = ds_config(MICRO, ACCUM, optimizer="sgd", zero_optimization={"stage": stage})
        engine, *_ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=config)
        losses = _direct_steps(engine, STEPS)
        params = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
        out[stage] = (losses, params, engine.get_global_grad_norm())
    return out


# DeepSpeed: at stages 1-3 a direct loss.backward() trains exactly as engine.backward(loss) (same grad norms and
# parameters: the gradients are divided by gradient_accumulation_steps and reduced, fp32 and bf16 alike); at
# stage 0 its first backward raises "Direct calls to tensor.backward() are not supported in this configuration".
# Before this change shardwise stepped on zero gradients at stages 2-3 (grad norm 0.0) and on each rank's own,
# unaveraged gradients at stages 0-1.
def test_direct_loss_backward_trains_as_engine_backward():
    # SGD: Adam would normalise away a gradient missing its 1/gradient_accumulation_steps.
    ref_losses, ref_params = oracle(STEPS, MICRO * ACCUM * 2, optimizer="sgd")
    for stage, (losses, params, norm) in run_distributed(_direct_sweep, 2)[0].items():
        assert norm > 1.0, f"stage {stage}: grad norm {norm}"
        assert_close_run(losses, params, ref_losses, ref_params, rtol=1e-5)


def _fp16_direct_sweep():
    messages = {}
    for stage in STAGES:
        model = make_model()
        config = ds_config(MICRO, ACCUM, fp16={"enabled": True}, zero_optimization={"stage": stage})
        engine, *_ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=config)
        engine(*micro_batch(0, 0, dist.get_rank(), MICRO, ACCUM, 2)).backward()
        with pytest.raises(RuntimeError) as error:
            engine.step()  # the first micro-step's step(), before any update
        messages[stage] = str(error.value)
    return messages


# DeepSpeed (read from deepspeed/runtime/engine.py, `_backward_post_hook`; fp16 does not run on its CPU
# accelerator): with dynamic loss scaling a direct backward raises "Loss scaling is required ... Please use
# engine.backward(loss) or engine.scale(loss).backward()"; with a static scale it steps on gradients divided by the
# scale they never got.
def test_direct_backward_under_fp16_is_refused_at_the_first_step():
    for stage, message in run_distributed(_fp16_direct_sweep, 2)[0].items():
        assert "engine.step(): gradients that engine.backward(loss) did not produce" in message, (stage, message)
        assert "with fp16 they lack the loss scale" in message and "Call engine.backward(loss)" in message


# DeepSpeed, the tutorial's loop: stage 0 matches the torch oracle (the generator's backward leaves gradients in
# the discriminator's param.grad and netD.zero_grad() clears them); stage 1 diverges from the oracle at the first
# step (its two discriminator backwards reduce twice); stages 2 and 3 fail with an AssertionError ("Gradient
# computed twice for this partition" / stage3.py's bucket check) when the generator's backward reaches the
# discriminator. Before this change shardwise's discriminator kept those gradients and stepped on them: the
# generator's loss diverged from the second iteration at every stage (from the first at stage 1, whose second
# reduction of a bucket averaged the first result with leftovers).
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("world", [1, 2])  # alone, stages 1-2 take stage 0's whole buckets (test_world_of_one.py)
def test_gan_two_engines_match_the_torch_oracle(stage, world):
    ref_d, ref_g = gan_oracle(6, world)
    d_losses, g_losses = run_distributed(gan_run, world, "shardwise", stage, 6)[0]
    for step, (a, b, c, d) in enumerate(zip(d_losses, ref_d, g_losses, ref_g)):
        assert abs(a - b) <= 1e-5 * abs(b) and abs(c - d) <= 1e-5 * abs(d), (
            f"stage {stage} step {step}: D {a} vs {b}, G {c} vs {d}")


def _two_backwards_sweep():
    out = {}
    for stage in STAGES:
        model = make_model()
        # Small buckets: the second loss reaches one of them only, so the others are reduced twice with nothing new.
        config = ds_config(MICRO, 1, optimizer="sgd", zero_optimization={"stage": stage, "reduce_bucket_size": 300})
        engine, *_ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=config)
        for step in range(3):
            engine.backward(engine(*micro_batch(step, 0, dist.get_rank(), MICRO, 1, 2)))
            engine.backward(_penalty(engine.module))
            engine.step()
        out[stage] = (len(engine.strategy.buckets.buckets), _full_params(engine))
    return out


def _penalty(model: torch.nn.Module) -> torch.Tensor:
    return 0.5 * model.out.weight.square().sum()


def _full_params(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}


def _two_backwards_oracle() -> dict[str, torch.Tensor]:
    from tests.parity import global_batch

    model = make_model()
    opt = torch.optim.SGD(param_groups(model), lr=1e-2, momentum=0.9)
    for step in range(3):
        model(*global_batch(step, MICRO * 2)).backward()
        _penalty(model).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# The DCGAN tutorial's discriminator calls engine.backward twice before one step (gradient_accumulation_steps 1):
# the gradients sum. DeepSpeed (same measurement, the GAN loop): right at stage 0, wrong at stage 1 (its second
# reduction averages the first result again), "Gradient computed twice" at stage 2. Before this change shardwise's
# stage 1 had the same fault.
def test_two_backwards_before_one_step_sum_their_gradients():
    ref = _two_backwards_oracle()
    for stage, (buckets, params) in run_distributed(_two_backwards_sweep, 2)[0].items():
        assert buckets > 3 or stage == 3, stage
        for name, value in ref.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"stage {stage} {name}: {m}")


def _no_backward_sweep():
    handler = LogMessages()
    logging.getLogger("shardwise.runtime.engine").addHandler(handler)
    out = {}
    for stage in STAGES:
        model = make_model()
        config = ds_config(MICRO, 1, zero_optimization={"stage": stage})
        engine, *_ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=config)
        losses = train_steps(engine, 0, 2)
        before = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
        engine.step()  # no backward since the last step
        after = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
        unchanged = all(torch.equal(before[k], after[k]) for k in before)
        counters = (engine.global_steps, engine.skipped_steps, engine.get_global_grad_norm())
        losses += train_steps(engine, 2, 2)
        params = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
        out[stage] = (unchanged, counters, losses, params)
    return out, handler.messages


# DeepSpeed: at stage 0 a step() without backward leaves the weights unchanged (torch's optimizer skips parameters
# without .grad) and counts the step (global_steps 3 after 2 trained steps); at stages 1-3 it raises
# "TypeError: 'NoneType' object is not iterable" from its gradient-norm code. Before this change shardwise stepped
# AdamW on zeroed gradients: the leftover moments moved every weight (by up to 1e-2 here).
def test_step_without_backward_leaves_weights_and_optimizer_state_unchanged():
    # The oracle: 4 steps; torch's AdamW.step() with no gradients in between changes nothing, not even its step count.
    ref_losses, ref_params = oracle(4, MICRO * 2)
    (results, messages), _ = run_distributed(_no_backward_sweep, 2)
    for stage, (unchanged, counters, losses, params) in results.items():
        assert unchanged, f"stage {stage}: weights moved without a gradient"
        assert counters == (3, 0, 0.0), stage
        assert_close_run(losses, params, ref_losses, ref_params, rtol=1e-5)  # moments and step count untouched
    assert messages.count("engine.step(): no gradient reached the model since the last step (step 3: no "
                          "engine.backward(loss) or loss.backward() before it); weights and optimizer state were "
                          "left unchanged. Call engine.backward(loss) before engine.step().") == len(STAGES)
