"""1-bit Adam, 0/1 Adam and 1-bit LAMB through the engine: exact warm-up against the oracle, compressed
training at world 2 and 4, the traffic they save, mixed precision, and the configurations they refuse."""

from __future__ import annotations

import pytest
import torch

from shardwise.config import ConfigError
from tests.harness import run_distributed
from tests.parity import assert_close_run, ds_config, engine_run, oracle

ADAM = {"lr": 1e-2, "betas": [0.9, 0.99], "eps": 1e-8}


def _config(optimizer: str, world: int, **params) -> dict:
    config = ds_config(8 // (2 * world), 2, lr=1e-2)
    config["optimizer"] = {"type": optimizer, "params": {**ADAM, **params}}
    return config


def _train(config: dict, steps: int, compressed_from: int | None = None):
    """Losses, whole params, and per-step data-group bytes of the steps after `compressed_from`."""
    losses, params, engine = engine_run(config, compressed_from or steps)
    stats = engine.comm.stats
    stats.reset()
    from tests.parity import train_steps

    later = train_steps(engine, compressed_from, steps - compressed_from) if compressed_from else []
    moved = {op: stats.elements(op, "data") * (1 if op != "all_reduce" else 4) for op in ("all_reduce", "all_to_all", "all_gather")}
    params = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return losses + later, params, moved


@pytest.mark.parametrize("optimizer,params", [
    ("OneBitAdam", {"freeze_step": 12}),
    ("ZeroOneAdam", {"var_freeze_step": 12, "var_update_scaler": 12}),
])
def test_warm_up_is_adam(optimizer, params):
    """Until the freeze every step averages gradients exactly and is AdamW: the oracle's losses and weights."""
    ref_losses, ref_params = oracle(12, 8, lr=1e-2)
    (losses, got, _), _ = run_distributed(_train, 2, _config(optimizer, 2, **params), 12)
    assert_close_run(losses, got, ref_losses, ref_params, rtol=1e-5)


def test_one_bit_lamb_warm_up_is_lamb():
    steps = 10
    lamb = {"type": "Lamb", "params": {**ADAM, "weight_decay": 0.01}}
    (ref_losses, ref_params, _), _ = run_distributed(_train, 2, {**_config("Lamb", 2), "optimizer": lamb}, steps)
    (losses, got, _), _ = run_distributed(_train, 2, _config("OneBitLamb", 2, weight_decay=0.01, freeze_step=steps), steps)
    assert_close_run(losses, got, ref_losses, ref_params, rtol=1e-6)


def _after_freeze(config: dict, steps: int, freeze: int):
    losses, params, moved = _train(config, steps, compressed_from=freeze)
    import torch.distributed as dist

    return losses, params, moved, dist.get_rank()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("optimizer,params,freeze", [
    ("OneBitAdam", {"freeze_step": 10}, 10),
    ("OneBitLamb", {"freeze_step": 10}, 10),
    # exact variance steps 1-8, then every other one to 16; compressed gradients in between, local steps after
    ("ZeroOneAdam", {"var_freeze_step": 16, "var_update_scaler": 8, "local_step_scaler": 4, "local_step_clipper": 4}, 16),
])
def test_trains_and_sends_less_after_the_freeze(world, optimizer, params, freeze):
    """Compressed steps keep training (the loss falls like the baseline's, within 25% on this tiny net) and move at
    least 5x fewer bytes per step than the exact warm-up steps' fp32 all-reduce."""
    steps = 40
    if optimizer == "OneBitLamb":  # its baseline is LAMB, which this net takes slower than AdamW
        lamb = {**_config("Lamb", world), "optimizer": {"type": "Lamb", "params": ADAM}}
        (ref_losses, _, _), *_ = run_distributed(_train, world, lamb, steps)
    else:
        ref_losses, _ = oracle(steps, 8, lr=1e-2)
    results = run_distributed(_after_freeze, world, _config(optimizer, world, **params), steps, freeze)
    losses, _, moved, _ = results[0]
    assert losses[-5:] != ref_losses[-5:]  # compression changes the run ...
    late, ref_late = sum(losses[-10:]) / 10, sum(ref_losses[-10:]) / 10
    assert late < 0.7 * losses[0] and late < 1.25 * ref_late, (late, ref_late, losses[0])  # ... but it trains
    numel = sum(p.numel() for p in results[0][1].values())
    exact_bytes = 4 * numel * (steps - freeze)  # what the warm-up's all-reduce of fp32 gradients would move
    compressed = moved["all_to_all"] + moved["all_gather"] + moved["all_reduce"]
    assert compressed * 5 <= exact_bytes, (moved, exact_bytes)
    if optimizer != "ZeroOneAdam":  # replicated weights after every step (0/1 Adam's differ between syncs)
        for _, params_r, _, _ in results[1:]:
            for name, value in params_r.items():
                assert torch.equal(value, results[0][1][name]), name


def test_zero_one_adam_syncs_rarely_and_agrees_at_syncs():
    """After var_freeze_step the ranks step alone and exchange only every local_step_interval steps (here 1, 1, then 2
    up to the clipper of 2): 10 local steps sync 6 times. Right after a sync every rank holds the same weights."""
    config = _config("ZeroOneAdam", 2, var_freeze_step=4, var_update_scaler=100, local_step_scaler=2, local_step_clipper=2)
    results = run_distributed(_after_freeze, 2, config, 14, 4)
    (_, p0, moved, _), (_, p1, _, _) = results
    assert moved["all_to_all"] > 0
    from shardwise.optim.onebit.zero_one_adam import _Schedule

    schedule = _Schedule(4, 100, 2, 2)
    syncs = [t for t in range(5, 15) if schedule.at(t).syncs(t)]
    assert syncs == [5, 6, 8, 10, 12, 14]
    assert 14 in syncs  # the last step synced: the weights agree bit for bit
    for name, value in p0.items():
        assert torch.equal(value, p1[name]), name


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_after_the_freeze(precision):
    config = _config("OneBitAdam", 2, freeze_step=5)
    config[precision] = {"enabled": True, **({"initial_scale_power": 8} if precision == "fp16" else {})}
    (losses, params, _, _), _ = run_distributed(_after_freeze, 2, config, 25, 5)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < 0.6 * losses[0], losses


def _overflow_on_rank1(config: dict):
    import torch.distributed as dist

    import shardwise
    from tests.parity import make_model, micro_batch, param_groups, train_steps

    model = make_model()
    engine, *_ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=config)
    train_steps(engine, 0, 3)  # past the freeze: gradients stay on their rank
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    for m in range(engine.gradient_accumulation_steps()):
        loss = engine(*micro_batch(3, m, dist.get_rank(), engine.train_micro_batch_size_per_gpu(), 2, 2))
        engine.backward(loss * (float("inf") if dist.get_rank() == 1 else 1.0))
        engine.step()
    return engine.skipped_steps, all(torch.equal(v, before[k]) for k, v in engine.module.state_dict().items())


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank():
    """Local gradients are never summed, so without the shared norm rank 0 would step and rank 1 skip: diverged."""
    results = run_distributed(_overflow_on_rank1, 2, _config("OneBitAdam", 2, freeze_step=2))
    assert results == [(1, True), (1, True)]


def _initialize(config: dict, instance: bool = False):
    import shardwise
    from shardwise.optim.onebit import OneBitAdam
    from tests.parity import make_model, param_groups

    model = make_model()
    optimizer = OneBitAdam(model.parameters(), freeze_step=3) if instance else None
    try:
        shardwise.initialize(model=model, model_parameters=param_groups(model), config=config, optimizer=optimizer)
    except (ConfigError, TypeError, ValueError) as e:
        return str(e)
    return None


@pytest.mark.parametrize("config_change,expected", [
    ({"zero_optimization": {"stage": 1}}, "zero_optimization.stage: onebitadam needs stage 0; got stage 1."),
    ({"optimizer": {"type": "OneBitAdam", "params": {"freeze_steps": 3}}},
     "optimizer.params.freeze_steps: unknown for OneBitAdam. Did you mean 'freeze_step'?"),
    ({"optimizer": {"type": "OneBitAdam", "params": {"freeze_step": 0}}}, "freeze_step: must be a whole number of steps >= 1"),
    ({"optimizer": {"type": "ZeroOneAdam", "params": {"amsgrad": True}}}, "amsgrad: is not supported by ZeroOneAdam"),
    ({"optimizer": {"type": "OneBitLamb", "params": {"comm_backend_name": "smoke"}}},
     "comm_backend_name: one of nccl, mpi, gloo, hccl, compressed is required; got 'smoke'."),
])
def test_refused_configurations(config_change, expected):
    config = {**_config("OneBitAdam", 2, freeze_step=3), **config_change}
    messages = run_distributed(_initialize, 2, config)
    assert messages[0] == messages[1] and messages[0] is not None and expected in messages[0], messages


def test_an_instance_passed_to_initialize_is_refused():
    messages = run_distributed(_initialize, 2, _config("Adam", 2), True)
    assert "optimizer: a OneBitAdam instance cannot be passed to initialize(); name it in the config" in messages[0]
