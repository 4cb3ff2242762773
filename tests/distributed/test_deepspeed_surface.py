"""The engine surface DeepSpeed scripts and Hugging Face call, at world size 2: the dict-like config,
attributes forwarded to the module, DeepSpeed's accessors, the throughput timer, `deepspeed.comm`'s
signatures, whole-parameter access (`safe_get_full_*`) and DeepSpeed's `zero_to_fp32` functions, each
checked against the single-process oracle."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from tests.parity import ds_config, engine_run, make_model, oracle, param_groups

STEPS, MICRO = 3, 2


def _surface():
    config = ds_config(MICRO, 1, bf16={"enabled": False}, zero_optimization={"stage": 2})
    config["train_batch_size"] = "auto"
    _, _, engine = engine_run(config, STEPS)
    engine.module.note = "from the module"
    try:
        engine.no_such_attribute
    except AttributeError as e:
        missing = str(e)
    return {
        "config_stage": engine.config.get("zero_optimization", {}).get("stage"),
        "config_batch_raw": engine.config["train_batch_size"],
        "typed_batch": engine.train_batch_size(),
        "forwarded": engine.note, "embed": engine.embed is engine.module.embed, "missing": missing,
        "flags": (engine.fp16_enabled(), engine.bfloat16_enabled(), engine.zero_optimization_stage(),
                  engine.zero_optimization(), engine.zero_cpu_offload(), engine.gradient_clipping()),
        "dp": (engine.dp_world_size, engine.mp_world_size), "steps": engine.tput_timer.global_step_count,
    }


def test_engine_surface():
    result = run_distributed(_surface, 2)[0]
    assert result["config_stage"] == 2 and result["config_batch_raw"] == "auto" and result["typed_batch"] == 4
    assert result["forwarded"] == "from the module" and result["embed"]
    assert "neither the engine nor its module (TinyNet) has an attribute 'no_such_attribute'" in result["missing"]
    assert result["flags"] == (False, False, 2, True, False, 0.0)
    assert result["dp"] == (2, 1) and result["steps"] == STEPS


def _comm():
    import torch.distributed as dist

    from shardwise.distributed import comm, init_distributed

    init_distributed()
    t = torch.tensor([float(dist.get_rank() + 1)])
    comm.all_reduce(t, op=comm.ReduceOp.SUM, prof=True, log_name="x", debug="y")
    out = torch.zeros(2)
    comm.allgather_fn(out, torch.tensor([float(comm.get_rank())]))
    comm.barrier(prof=False)
    return t.item(), out.tolist(), comm.get_world_size(), comm.get_local_rank(), comm.get_all_ranks_from_group()


def test_comm_takes_deepspeeds_keywords():
    for rank, (total, gathered, world, local, ranks) in enumerate(run_distributed(_comm, 2)):
        assert total == 3.0 and gathered == [0.0, 1.0] and world == 2 and local == rank and ranks == [0, 1]


def _param_access(stage):
    from shardwise.runtime.param_access import (
        safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_set_full_fp32_param)

    _, _, engine = engine_run(ds_config(MICRO, 1, zero_optimization={"stage": stage}), STEPS)
    named = dict(engine.module.named_parameters())
    full = {name: safe_get_full_fp32_param(p) for name, p in named.items()}
    exp_avg = safe_get_full_optimizer_state(named["hidden.weight"], "exp_avg")
    new = torch.full_like(full["out.bias"], 0.5)
    safe_set_full_fp32_param(named["out.bias"], new)
    after = safe_get_full_fp32_param(named["out.bias"])
    with pytest.raises(ValueError, match="frozen parameters have no optimizer state"):
        safe_get_full_optimizer_state(named["frozen.weight"], "exp_avg")
    return full, exp_avg, after


def _oracle_exp_avg():
    model = make_model()
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2, betas=(0.9, 0.99), eps=1e-8)
    from tests.parity import global_batch

    for step in range(STEPS):
        model(*global_batch(step, MICRO * 2)).backward()
        opt.step()
        opt.zero_grad()
    return opt.state[model.hidden.weight]["exp_avg"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_safe_get_full_matches_the_oracle(stage):
    _, ref = oracle(STEPS, MICRO * 2)
    ref_exp_avg = _oracle_exp_avg()
    for full, exp_avg, after in run_distributed(_param_access, 2, stage):
        for name, value in full.items():
            torch.testing.assert_close(value, ref[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(exp_avg, ref_exp_avg, rtol=1e-5, atol=1e-7)
        assert torch.equal(after, torch.full_like(after, 0.5))


def _save(stage, path):
    _, params, engine = engine_run(ds_config(MICRO, 1, zero_optimization={"stage": stage}), STEPS)
    engine.save_checkpoint(path)
    return params


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_to_fp32_functions(stage, tmp_path):
    from shardwise.checkpoint.fp32 import (
        convert_zero_checkpoint_to_fp32_state_dict, get_fp32_state_dict_from_zero_checkpoint,
        load_state_dict_from_zero_checkpoint)

    run_distributed(_save, 2, stage, str(tmp_path / "ckpt"))
    _, ref = oracle(STEPS, MICRO * 2)
    state = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
    assert set(state) == set(ref)
    for name, value in ref.items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    lazy = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt", exclude_frozen_parameters=True, lazy_mode=True)
    assert "frozen.weight" not in lazy and torch.equal(lazy["out.bias"].contiguous(), state["out.bias"])
    files = convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / "bin", max_shard_size="4KB")
    assert len(files) > 1 and (tmp_path / "bin" / "pytorch_model.bin.index.json").is_file()
    loaded = {}
    for f in files:
        loaded.update(torch.load(f, weights_only=True))
    assert set(loaded) == set(state) and all(torch.equal(loaded[k], state[k]) for k in state)
    files = convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / "st", safe_serialization=True)
    assert [f.name for f in files] == ["model.safetensors"]
    model = load_state_dict_from_zero_checkpoint(make_model(seed=5), tmp_path / "ckpt")
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, ref[name], rtol=1e-5, atol=1e-6)
