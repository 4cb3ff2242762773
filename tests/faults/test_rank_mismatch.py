"""Ranks that start differently are refused at `initialize`, on every rank, naming the first difference.

Found by a probe: a rank started with another ZeRO stage (or config) issued other collectives than its
peers and the job hung until the 30-minute collective timeout, whose message did not mention the
difference. Each case below starts rank 1 differently from rank 0 and expects, on both ranks and within
seconds (the timeout stays at its 1800 s default), a `RankMismatchError` naming the difference.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

import shardwise
from shardwise.distributed import RankMismatchError
from tests.harness import run_distributed
from tests.parity import ds_config, make_model, param_groups


class Layers(torch.nn.Module):
    def __init__(self, width: int = 32, out_bias: bool = True) -> None:
        super().__init__()
        self.layer = torch.nn.Sequential(torch.nn.Linear(24, width), torch.nn.Linear(width, 24, bias=out_bias))


def _tiny(config: dict[str, Any] | None = None, model: Callable[[], torch.nn.Module] = make_model,
          groups: Callable[[torch.nn.Module], Any] = param_groups, env: dict[str, str] | None = None) -> dict[str, Any]:
    return {"config": ds_config(2, 1, **(config or {})), "model": model, "groups": groups, "env": env or {}}


def _decay_biases_too(model: torch.nn.Module) -> list[dict[str, Any]]:
    groups = param_groups(model)
    groups[0]["params"].append(groups[1]["params"].pop(0))  # frozen.bias, the first 1-d parameter
    return groups


# (rank 0's setup, rank 1's setup, the message both ranks must raise)
CASES: dict[str, tuple[dict, dict, str]] = {
    "zero stage": (
        _tiny({"zero_optimization": {"stage": 2}}), _tiny({"zero_optimization": {"stage": 3}}),
        "config: every rank must start with the same; rank 1 differs from rank 0: zero_optimization.stage: "
        "2 on rank 0, 3 on rank 1. Pass every rank the same config"),
    "learning rate": (
        _tiny({"lr": 1e-2}), _tiny({"lr": 2e-2}),
        "rank 1 differs from rank 0: optimizer.params.lr: 0.01 on rank 0, 0.02 on rank 1."),
    "one shape": (
        _tiny(model=lambda: Layers(32)), _tiny(model=lambda: Layers(24)),
        "parameters: every rank must start with the same; rank 1 differs from rank 0: parameter 'layer.0.weight': "
        "shape (32, 24) on rank 0, (24, 24) on rank 1. Build the same model on every rank"),
    "a missing parameter": (
        _tiny(model=lambda: Layers(out_bias=True)), _tiny(model=lambda: Layers(out_bias=False)),
        "parameters: every rank must start with the same; rank 1 differs from rank 0: rank 1 lacks parameters "
        "rank 0 has: 'layer.1.bias'."),
    "another optimizer group split": (
        _tiny(), _tiny(groups=_decay_biases_too),
        "optimizer groups: every rank must start with the same; rank 1 differs from rank 0: parameter "
        "'frozen.bias': group 1 on rank 0, 0 on rank 1. Pass every rank the same parameter groups"),
    "shared memory on one rank only": (
        _tiny(), _tiny(env={"SHARDWISE_SHM_COLLECTIVES": "0"}),
        "world: every rank must start with the same; rank 1 differs from rank 0: SHARDWISE_SHM_COLLECTIVES: "
        "on (shared-memory collectives) on rank 0, 0 (gloo only) on rank 1."),
}


def _start(setup: dict[str, Any]) -> None:
    old_env = {k: os.environ.get(k) for k in setup["env"]}
    os.environ.update(setup["env"])
    try:
        model = setup["model"]()
        shardwise.initialize(model=model, model_parameters=setup["groups"](model), config=setup["config"])
    finally:
        for key, value in old_env.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)


def _every_case() -> dict[str, tuple[str, float]]:
    shardwise.init_distributed()
    outcomes = {}
    for name, setups in CASES.items():
        dist.barrier()
        start = time.monotonic()
        try:
            _start(setups[dist.get_rank()])
            outcomes[name] = ("started", time.monotonic() - start)
        except RankMismatchError as e:
            outcomes[name] = (str(e), time.monotonic() - start)
    return outcomes


def test_ranks_that_start_differently_are_refused_on_every_rank_naming_the_difference():
    rank0, rank1 = run_distributed(_every_case, 2, timeout=240)
    for name, (_, _, expected) in CASES.items():
        (message0, seconds0), (message1, seconds1) = rank0[name], rank1[name]
        assert message0 == message1, name  # the same error on both ranks
        assert expected in message0, (name, message0)
        # Not a timeout: the collective timeout is its default 1800 s.
        assert seconds0 < 30 and seconds1 < 30, (name, seconds0, seconds1)


def _agreeing_ranks_start() -> list[str]:
    """What may differ per rank does not stop a start: rank 0's output paths, the timeouts; a zero.Init model
    is compared by its whole shapes."""
    shardwise.init_distributed()
    rank = dist.get_rank()
    config = ds_config(2, 1, collective_timeout_s=600 + rank, collective_warn_after_s=30 + rank,
                       tensorboard={"enabled": False, "output_path": f"/tmp/rank{rank}", "job_name": f"job{rank}"},
                       zero_optimization={"stage": 3})
    started = []
    model = make_model()
    shardwise.initialize(model=model, model_parameters=param_groups(model), config=config)
    started.append("per-rank paths and timeouts")
    with shardwise.zero.Init():
        partitioned = Layers(32 if rank == 0 else 24)
    try:
        shardwise.initialize(model=partitioned, config=config)
        started.append("zero.Init shapes")
    except RankMismatchError as e:
        started.append(str(e))
    return started


def test_what_may_differ_per_rank_does_not_stop_a_start_and_zero_init_shapes_are_whole():
    rank0, rank1 = run_distributed(_agreeing_ranks_start, 2, timeout=120)
    assert rank0[0] == rank1[0] == "per-rank paths and timeouts"
    assert rank0[1] == rank1[1]
    # The partitioned parameters hold 0 elements locally; their whole shapes are compared.
    assert "parameter 'layer.0.weight': shape (32, 24) on rank 0, (24, 24) on rank 1" in rank0[1]
