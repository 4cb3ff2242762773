"""DeepSpeedExamples' training/bf16_master_weight/configs/bf16_full.json under DeepSpeed 0.19 and under shardwise.

The example's config (bf16 master weights and gradients, bf16 optimizer state, torch_autocast in bf16, ZeRO 3
with no persistent parameters), with two changes: a learning rate of 1e-2 instead of 1e-4, so that a few steps
move the weights by more than bf16's rounding, and the stage swept over 1, 2 and 3 with torch_autocast on and
off. `TinyNet` trains 6 steps at world size 2 in each library; the losses (mean over the global batch) must
agree within two bf16 ulps (2**-7 relative): both step bf16 weights with bf16 Adam moments, but DeepSpeed's
CPU FusedAdam and torch's AdamW round their bf16 arithmetic differently, and DeepSpeed's stage 3 under autocast
computes its first forward from other roundings (measured: at most 3.4e-3 relative).

DeepSpeed is a reference here, never a dependency: without it the module skips (tests/reference.py); `make
test-deepspeed` runs it, or by hand:

    DS_ACCELERATOR=cpu PYTHONPATH=src:. .dsvenv/bin/python -m pytest tests/distributed/test_deepspeed_parity_bf16_masters.py -q
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

from tests.reference import real_deepspeed

real_deepspeed()  # imported once here so the forked ranks inherit it; skips in shardwise's own venv

from tests.harness import run_distributed  # noqa: E402
from tests.parity import make_model, micro_batch  # noqa: E402

WORLD, STEPS, MICRO = 2, 6, 2
RTOL = 2**-7
CASES = [(stage, autocast) for stage in (1, 2, 3) for autocast in (True, False)]


def _config(stage: int, autocast: bool) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10_000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
        "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
        "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                              "reduce_bucket_size": 5e7, "stage3_param_persistence_threshold": 0},
        "torch_autocast": {"enabled": autocast, "dtype": "torch.bfloat16"},
    }


def _train_one(ds: Any, stage: int, autocast: bool) -> dict[str, Any]:
    import torch.distributed as dist

    model = make_model()
    engine, optimizer, _, _ = ds.initialize(model=model, model_parameters=model.parameters(),
                                            config=_config(stage, autocast))
    rank = dist.get_rank()
    losses = []
    for step in range(STEPS):
        loss = engine(*micro_batch(step, 0, rank, MICRO, 1, WORLD))
        engine.backward(loss)
        engine.step()
        total = loss.detach().float()
        dist.all_reduce(total)
        losses.append(total.item() / WORLD)
    states = {str(v.dtype) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0}
    return {"losses": losses, "state_dtypes": states}


def _sweep(library: str) -> dict[tuple[int, bool], dict[str, Any]]:
    ds = importlib.import_module(library)
    if library == "deepspeed":
        ds.init_distributed(dist_backend="gloo")
    return {case: _train_one(ds, *case) for case in CASES}


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[tuple[int, bool], dict[str, Any]]]:
    return {library: run_distributed(_sweep, WORLD, library, timeout=600)[0] for library in ("deepspeed", "shardwise")}


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"stage{c[0]}-autocast{'on' if c[1] else 'off'}")
def test_bf16_full_matches_deepspeed(runs, case):
    ours, theirs = runs["shardwise"][case], runs["deepspeed"][case]
    assert theirs["state_dtypes"] == {"torch.bfloat16"}, theirs  # what the keys ask of DeepSpeed too
    assert ours["state_dtypes"] == {"torch.bfloat16"}, ours
    for step, (a, b) in enumerate(zip(ours["losses"], theirs["losses"])):
        assert abs(a - b) <= RTOL * abs(b), (f"step {step}: loss {a} vs DeepSpeed {b}\nshardwise: {ours['losses']}\n"
                                             f"DeepSpeed: {theirs['losses']}")
    assert ours["losses"][-1] < ours["losses"][0] - 1.0, ours["losses"]  # lr 1e-2 trains visibly in 6 steps
