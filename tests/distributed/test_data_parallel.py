"""Stage 0 (data parallel) against the single-process oracle, at world sizes 1, 2 and 4."""

from __future__ import annotations

import pytest

from tests.harness import run_distributed
from tests.parity import assert_close_run, ds_config, engine_run, oracle

STEPS = 20


def _train(config):
    losses, params, engine = engine_run(config, STEPS)
    return losses, params, engine.comm.stats.calls("all_reduce", "data")


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_fp32_matches_oracle(world, optimizer):
    micro, accum = 4 // world if world < 4 else 1, 2
    batch = micro * accum * world
    lr = 1e-2 if optimizer == "adamw" else 0.1
    ref_losses, ref_params = oracle(STEPS, batch, lr=lr, optimizer=optimizer)
    (losses, params, _), *_ = run_distributed(_train, world, ds_config(micro, accum, lr=lr, optimizer=optimizer))
    assert_close_run(losses, params, ref_losses, ref_params, rtol=1e-5)


def test_clipping_matches_torch_clip_grad_norm():
    ref_losses, ref_params = oracle(STEPS, 8, clip=2.0, lr=0.1, optimizer="sgd")
    (losses, params, _), _ = run_distributed(_train, 2, ds_config(2, 2, clip=2.0, lr=0.1, optimizer="sgd"))
    assert_close_run(losses, params, ref_losses, ref_params, rtol=1e-5)
