"""DeepSpeed config spellings and keys at world size 2: aliases train as their canonical spellings, and
torch_autocast and Lion match a plain torch oracle."""

from __future__ import annotations

import logging
import math
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist

import shardwise
from tests.harness import run_distributed
from tests.logs import LogMessages
from tests.parity import (
    assert_close_run,
    ds_config,
    engine_run,
    full_state_dict,
    global_batch,
    make_model,
    micro_batch,
    param_groups,
    train_steps,
)

STEPS, MICRO, ACCUM, WORLD = 6, 2, 2, 2

# Stage 3 with CPU offload, every key in a DeepSpeed spelling shardwise did not accept before ...
ALIASES = {
    "stage": 3, "prefetch_bucket_size": 300, "param_persistence_threshold": 100, "max_live_parameters": 3000,
    "max_reuse_distance": 0, "gather_16bit_weights_on_model_save": True, "model_persistence_threshold": sys.maxsize,
    "module_granularity_threshold": 50, "use_all_reduce_for_fetch_params": True, "cpu_offload": True,
    "cpu_offload_use_pin_memory": False,
}
# ... and the same in shardwise's (stage3_*) spelling.
CANONICAL = {
    "stage": 3, "stage3_prefetch_bucket_size": 300, "stage3_param_persistence_threshold": 100,
    "stage3_max_live_parameters": 3000, "stage3_max_reuse_distance": 0, "stage3_gather_16bit_weights_on_model_save": True,
    "stage3_module_granularity_threshold": 50,
    "offload_optimizer": {"device": "cpu", "pin_memory": False},
}


def _units(engine: Any) -> list[tuple[int, bool]]:
    return [(sum(p.numel() for p in u.params), u.persistent) for u in engine.strategy.units]


def _stage3_run(zero: dict[str, Any]):
    model = make_model()
    shardwise.zero.register_external_parameter(model, model.embed.weight)  # the root forward reads the embedding
    engine, *_ = shardwise.initialize(model=model, model_parameters=param_groups(model),
                                      config=ds_config(MICRO, ACCUM, zero_optimization=zero))
    losses = train_steps(engine, 0, STEPS)
    params = {k: v.float() for k, v in full_state_dict(engine).items()}
    return losses, params, _units(engine), engine.config.zero_optimization


def _alias_runs():
    return {name: _stage3_run(zero) for name, zero in (("aliases", ALIASES), ("canonical", CANONICAL),
                                                        ("default", {"stage": 3}))}


def test_deepspeed_spellings_train_like_the_canonical_ones():
    ref_losses, ref_params = _oracle(lambda m: torch.optim.AdamW(param_groups(m), lr=1e-2, betas=(0.9, 0.99), eps=1e-8))
    for runs in run_distributed(_alias_runs, WORLD, timeout=240):
        losses, params, units, zero = runs["aliases"]
        assert losses == runs["canonical"][0]  # the same computation, bit for bit
        assert zero == runs["canonical"][3] and zero.offload_optimizer.device == "cpu"
        assert units == runs["canonical"][2]
        # the persistence threshold took effect: with DeepSpeed's default (1e5) every TinyNet unit stays whole
        assert any(not persistent for _, persistent in units)
        assert all(persistent for _, persistent in runs["default"][2])
        assert_close_run(losses, params, ref_losses, ref_params, rtol=1e-5)


def _oracle(make_opt: Callable[[torch.nn.Module], torch.optim.Optimizer], autocast: bool = False):
    """One process, data-parallel arithmetic: every rank's micro-batch run separately (so bf16 sees the same
    shapes as on the ranks), gradients summed, scaled by 1 / (accumulation × world)."""
    model = make_model()
    opt = make_opt(model)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for m in range(ACCUM):
            for rank in range(WORLD):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    loss = model(*micro_batch(step, m, rank, MICRO, ACCUM, WORLD))
                (loss / (ACCUM * WORLD)).backward()
                total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total / (ACCUM * WORLD))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _autocast_and_lion_runs():
    config = ds_config(MICRO, ACCUM, zero_optimization={"stage": 1},
                       torch_autocast={"enabled": True, "dtype": "bfloat16",
                                       "lower_precision_safe_modules": ["torch.nn.modules.linear.Linear"]})
    model = make_model()
    engine, *_ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=config)
    seen = []
    engine.module.hidden.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    autocast = (train_steps(engine, 0, STEPS), full_state_dict(engine),
                set(seen), {p.dtype for p in engine.module.parameters()})
    lion_config = ds_config(MICRO, ACCUM, zero_optimization={"stage": 2})
    lion_config["optimizer"] = {"type": "Lion", "params": {"lr": 1e-3, "betas": [0.9, 0.99], "weight_decay": 0.1}}
    lion = engine_run(lion_config, STEPS)[:2]
    return autocast, lion, dist.get_rank()


def test_torch_autocast_matches_a_torch_autocast_oracle_and_lion_trains_sharded():
    from shardwise.optim.lion import Lion

    ref_autocast = _oracle(lambda m: torch.optim.AdamW(param_groups(m), lr=1e-2, betas=(0.9, 0.99), eps=1e-8), True)
    ref_fp32 = _oracle(lambda m: torch.optim.AdamW(param_groups(m), lr=1e-2, betas=(0.9, 0.99), eps=1e-8))
    ref_lion = _oracle(lambda m: Lion(param_groups(m), lr=1e-3, betas=(0.9, 0.99)))  # groups set weight decay
    for (losses, params, seen, dtypes), (lion_losses, lion_params), _ in run_distributed(_autocast_and_lion_runs, WORLD,
                                                                                        timeout=240):
        assert seen == {torch.bfloat16} and dtypes == {torch.float32}  # autocast ran; weights stayed fp32
        assert_close_run(losses, params, *ref_autocast, rtol=1e-5)
        assert max(abs(a - b) for a, b in zip(losses, ref_fp32[0])) > 1e-4  # and it is not the fp32 run
        assert_close_run(lion_losses, lion_params, *ref_lion, rtol=1e-5)


def test_global_batch_is_the_ranks_micro_batches():
    # The oracle above runs the ranks' micro-batches one by one; they must tile the global batch.
    tokens, _ = global_batch(0, MICRO * ACCUM * WORLD)
    tiles = [micro_batch(0, m, r, MICRO, ACCUM, WORLD)[0] for m in range(ACCUM) for r in range(WORLD)]
    assert torch.equal(torch.cat(tiles), tokens)


def _initialize_runs():
    from shardwise.config import notes

    notes._given.clear()  # a fresh process would not have given these notes yet
    messages = LogMessages()
    logging.getLogger("shardwise").addHandler(messages)
    model = make_model()
    client = torch.optim.SGD(param_groups(model), lr=0.5)
    config = ds_config(MICRO, 1, scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 3}})
    engine, optimizer, _, scheduler = shardwise.initialize(
        model=model, optimizer=client, lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5),
        config=config)
    train_steps(engine, 0, 2)
    client_wins = (optimizer is client, type(scheduler).__name__, [g["lr"] for g in optimizer.param_groups])
    # dataloader_drop_last: 10 samples, 2 ranks, micro-batches of 4: 5 samples per rank, one full batch
    data = torch.utils.data.TensorDataset(torch.arange(10))
    batches = {}
    for drop in (False, True):
        _, _, loader, _ = shardwise.initialize(model=make_model(), config={**ds_config(4, 1), "dataloader_drop_last": drop},
                                              training_data=data)
        batches[drop] = len(list(loader))
    return client_wins, batches, _bf16_overflow(), messages.messages


def _bf16_overflow():
    """A non-finite gradient on one rank: the bf16 step is skipped on every rank (DeepSpeed's check_grad_overflow)."""
    model = make_model()
    engine, *_ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=ds_config(
        MICRO, 1, bf16={"enabled": True, "check_grad_overflow": True}))
    hook = engine.module.hidden.weight.register_hook(lambda g: g * math.inf) if dist.get_rank() == 1 else None
    before = engine.module.hidden.weight.detach().clone()
    engine.backward(engine(*micro_batch(0, 0, dist.get_rank(), MICRO, 1, WORLD)))
    engine.step()
    if hook:
        hook.remove()
    after = engine.module.hidden.weight
    return engine.was_step_applied(), bool(torch.isfinite(after).all()), torch.equal(before, after)


def test_client_optimizer_and_scheduler_win_over_the_config_with_a_warning_and_loader_and_bf16_keys_act():
    for rank, ((is_client, scheduler, lrs), batches, bf16, messages) in enumerate(
            run_distributed(_initialize_runs, WORLD, timeout=240)):
        assert is_client and scheduler == "StepLR" and lrs == [0.125, 0.125]  # 0.5 halved by StepLR at each step
        assert batches == {False: 2, True: 1}
        assert bf16 == (False, True, True)  # skipped on every rank: weights unchanged and finite
        warned = [m for m in messages if "is ignored, as DeepSpeed does" in m]
        if rank > 0:  # the warnings are the same on every rank: rank 0 alone gives them
            assert not warned, messages
            continue
        assert ("optimizer: the optimizer passed to initialize() is used and the config's \"optimizer\" section (type "
                "'adamw', params {'lr': 0.01, 'betas': [0.9, 0.99], 'eps': 1e-08}) is ignored, as DeepSpeed does. "
                "Remove one of the two to silence this.") in messages
        assert ("lr_scheduler: the scheduler passed to initialize() is used and the config's \"scheduler\" section "
                "(type 'WarmupLR') is ignored, as DeepSpeed does. Remove one of the two to silence this.") in messages
