"""The same script, config and seed under DeepSpeed 0.19 and under shardwise: the same fp32 run.

One worker trains `TinyNet` for a few steps at world size 2 with either library imported as `ds`
(`ds.initialize(model=..., model_parameters=..., config=cfg)`, then forward / backward / step on
deterministic micro-batches) and records, per optimizer step, the loss (mean over the global batch),
the lr and betas each param group stepped with, and the final parameters. DeepSpeed's numbers are
computed in the same test run and shardwise's must match them: lrs and betas to 1e-12 (both are plain
Python float arithmetic), losses and parameters to 1e-5 relative (the Adam kernels differ: DeepSpeed's
CPU FusedAdam takes lr, betas and bias corrections as fp32 and multiplies by 1/sqrt(bias_correction2)
where torch divides in double, so the two drift apart by a few ulps per step; measured: at most 4e-7
relative over 12 steps).

DeepSpeed is a reference here, never a dependency: without it the whole module skips (see
tests/reference.py). `make test-deepspeed` runs it, as .ci/run does, or by hand:

    DS_ACCELERATOR=cpu PYTHONPATH=src:. .dsvenv/bin/python -m pytest tests/distributed/test_deepspeed_parity.py -q

DeepSpeed's first run on a machine builds its CPU FusedAdam op (about a minute).
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import pytest
import torch

from tests.reference import real_deepspeed

real_deepspeed()  # imported once here so the forked ranks inherit it; skips in shardwise's own venv

from tests.harness import run_distributed  # noqa: E402
from tests.parity import full_state_dict, make_model, micro_batch, param_groups  # noqa: E402

WORLD = 2
STEPS = 12
RTOL = 1e-5  # fp32 throughout; see the module docstring for why it is not exact

ADAM = {"lr": 1e-2, "betas": [0.9, 0.99], "eps": 1e-8}

# name -> (config, parameter grouping). "groups" passes TinyNet's decay / no-decay param groups as
# model_parameters; "flat" passes model.parameters(), so only the config's optimizer params apply.
CASES: dict[str, tuple[dict[str, Any], str]] = {
    # DeepSpeed's "Adam" is AdamW (decoupled weight decay) unless adam_w_mode is false: a weight decay
    # in the config over one flat group tells the two apart.
    "adam-warmuplr-gas2": ({
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "Adam", "params": {**ADAM, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR",
                      "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2, "warmup_num_steps": 5}},
    }, "flat"),
    "adamw-warmupdecaylr-clip": ({
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": ADAM},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"total_num_steps": STEPS, "warmup_max_lr": 2e-2, "warmup_num_steps": 4,
                                 "warmup_type": "linear"}},
    }, "groups"),
    "sgd-momentum-warmupcosinelr": ({
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": STEPS, "warmup_num_steps": 4, "warmup_min_ratio": 0.1,
                                 "cos_min_ratio": 0.05}},
    }, "groups"),
    "onecycle-adam": ({
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "Adam", "params": ADAM},
        "scheduler": {"type": "OneCycle",
                      "params": {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 4,
                                 "cycle_second_step_size": 3, "decay_step_size": 2, "decay_lr_rate": 0.2,
                                 "cycle_min_mom": 0.85, "cycle_max_mom": 0.95, "decay_mom_rate": 0.05}},
    }, "groups"),
    # The keys the four configs above set explicitly, left out: each library's own default applies.
    # DeepSpeed 0.19 clips gradients at 1.0 unless told otherwise (GRADIENT_CLIPPING_DEFAULT in
    # deepspeed/runtime/constants.py) ...
    "default-gradient-clipping": ({
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
    }, "groups"),
    # ... and its default Adam (FusedAdam, or DeepSpeedCPUAdam when offloading) has weight_decay 0.0.
    "default-adam-weight-decay": ({
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
    }, "flat"),
}  # fmt: skip

# What a mismatch in a case most likely means, for the failure message.
HINTS = {
    "default-gradient-clipping": "DeepSpeed 0.19 defaults gradient_clipping to 1.0 "
                                 "(deepspeed/runtime/constants.py GRADIENT_CLIPPING_DEFAULT); is shardwise's default 0.0?",
    "default-adam-weight-decay": "DeepSpeed's Adam/AdamW (FusedAdam, DeepSpeedCPUAdam) default weight_decay to 0.0; "
                                 "torch.optim.AdamW defaults it to 0.01 (DeepSpeed only gets 0.01 with torch_adam: true).",
}


def _train_one(ds: Any, config: dict[str, Any], grouping: str) -> dict[str, Any]:
    import torch.distributed as dist

    model = make_model()
    params = param_groups(model) if grouping == "groups" else model.parameters()
    engine, optimizer, _, scheduler = ds.initialize(model=model, model_parameters=params,
                                                    config={**config, "steps_per_print": 10_000})
    rank, world = dist.get_rank(), dist.get_world_size()
    micro, accum = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
    losses, lrs, betas = [], [], []
    for step in range(STEPS):
        # What this step's update will use: the scheduler set it at construction or after the last step.
        lrs.append([float(g["lr"]) for g in optimizer.param_groups])
        betas.append([tuple(map(float, g["betas"])) for g in optimizer.param_groups if "betas" in g])
        total = torch.zeros(())
        for m in range(accum):
            loss = engine(*micro_batch(step, m, rank, micro, accum, world))
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)
        losses.append(total.item() / (accum * world))
    final = {k: v.float() for k, v in full_state_dict(engine).items()}
    return {"losses": losses, "lrs": lrs, "betas": betas, "params": final,
            "optimizer": type(optimizer).__name__, "scheduler": type(scheduler).__name__}


def _sweep(library: str) -> dict[str, dict[str, Any]]:
    """Every case in one set of ranks (start-up is the slow part); `library` is imported as `ds`."""
    ds = importlib.import_module(library)
    if library == "deepspeed":
        ds.init_distributed(dist_backend="gloo")
    return {name: _train_one(ds, config, grouping) for name, (config, grouping) in CASES.items()}


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[str, dict[str, Any]]]:
    out = {}
    for library in ("deepspeed", "shardwise"):
        per_rank = run_distributed(_sweep, WORLD, library, timeout=600)
        for name in CASES:  # every rank reports the same global losses and replicated parameters
            for other in per_rank[1:]:
                assert other[name]["losses"] == per_rank[0][name]["losses"], f"{library} {name}: ranks disagree"
        out[library] = per_rank[0]
    return out


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


@pytest.mark.parametrize("case", list(CASES))
def test_matches_deepspeed(runs, case):
    ours, theirs = runs["shardwise"][case], runs["deepspeed"][case]
    for step, (lr, ds_lr) in enumerate(zip(ours["lrs"], theirs["lrs"])):
        assert lr == pytest.approx(ds_lr, rel=1e-12, abs=0), f"step {step}: lr {lr} vs DeepSpeed {ds_lr}"
    for step, (b, ds_b) in enumerate(zip(ours["betas"], theirs["betas"])):
        assert [x for pair in b for x in pair] == pytest.approx([x for pair in ds_b for x in pair], rel=1e-12), (
            f"step {step}: betas {b} vs DeepSpeed {ds_b}")
    diffs = [_relative(a, b) for a, b in zip(ours["losses"], theirs["losses"])]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    assert diffs[worst] <= RTOL, (
        f"step {worst}: loss {ours['losses'][worst]!r} vs DeepSpeed {theirs['losses'][worst]!r} "
        f"(relative {diffs[worst]:.2e}); shardwise {ours['optimizer']} vs DeepSpeed {theirs['optimizer']}\n"
        f"shardwise losses: {ours['losses']}\nDeepSpeed losses: {theirs['losses']}\n{HINTS.get(case, '')}")
    for name, ref in theirs["params"].items():
        torch.testing.assert_close(ours["params"][name], ref, rtol=RTOL, atol=RTOL, msg=lambda m: f"{name}: {m}")
    assert all(math.isfinite(x) for x in ours["losses"])
