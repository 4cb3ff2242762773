"""A run moved from DeepSpeed mid-way: DeepSpeed 0.19.8 saves at step 3 (world size 2), shardwise loads that
checkpoint at world size 1, 2 and 4 and at other ZeRO stages, and its next steps have the losses the
uninterrupted DeepSpeed run had.

DeepSpeed trains `TinyNet` (two optimizer groups, a frozen parameter, sizes that do not divide by 2 or 4) for
3 steps, saves, and trains 3 more: those 3 losses are the reference. shardwise builds the same model and
config at another layout (the same global batch of 4: micro-batch 4 // world), calls `load_checkpoint` on
DeepSpeed's save directory, and trains the same 3 steps. fp32 losses agree within 1e-5 relative (the Adam
kernels differ by a few ulps a step; see test_deepspeed_parity.py); bf16 within two bf16 ulps (2**-7),
as in test_deepspeed_parity_bf16_masters.py; fp16 within one fp16 ulp (2**-10), the loss scale taken over
from DeepSpeed's (shardwise starts at another one).

DeepSpeed is a reference here, never a dependency: `make test-deepspeed` runs this module in .dsvenv, or by
hand:

    DS_ACCELERATOR=cpu PYTHONPATH=src:. .dsvenv/bin/python -m pytest tests/distributed/test_deepspeed_checkpoint_migration.py -q
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.reference import real_deepspeed

real_deepspeed()  # imported once here so the forked ranks inherit it; skips in shardwise's own venv

from tests.harness import run_distributed  # noqa: E402
from tests.deepspeed_checkpoints import (  # noqa: E402
    MORE, SAVED_AT, config, resume, resumed_precision, save_and_continue, step_on)
from tests.parity import make_model, param_groups  # noqa: E402

FP32_RTOL, BF16_RTOL, FP16_RTOL = 1e-5, 2**-7, 2**-10

# name -> (ZeRO section, precision section) DeepSpeed saves with.
SAVED: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "zero0": ({"stage": 0}, {}),
    "zero0-fp16": ({"stage": 0}, {"fp16": {"enabled": True, "initial_scale_power": 8}}),
    "zero0-bf16": ({"stage": 0}, {"bf16": {"enabled": True}}),
    "zero1": ({"stage": 1}, {}),
    "zero2": ({"stage": 2}, {}),
    "zero3": ({"stage": 3}, {}),
    "zero3-offload": ({"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}, {}),
    "zero2-bf16": ({"stage": 2}, {"bf16": {"enabled": True}}),
    "zero3-fp16": ({"stage": 3}, {"fp16": {"enabled": True, "initial_scale_power": 8}}),
}
# (saved case, shardwise's world size, shardwise's stage): every saved case at 1, 2 and 4 ranks at its own
# stage, and the stages crossed (2 -> 3, 3 -> 1, 1 -> 0, 0 -> 2, 0 -> 3). DeepSpeed's stage-0 fp16 optimizer
# state is refused (test_stage0_fp16_optimizer_state_is_refused): its save is kept for that test.
_ALL = {(case, world, zero["stage"]) for case, (zero, _) in SAVED.items() for world in (1, 2, 4)}
LOADS = sorted((_ALL | {("zero2", 2, 3), ("zero3", 4, 1), ("zero1", 2, 0), ("zero3-offload", 1, 2), ("zero0", 2, 2),
                        ("zero0-bf16", 4, 3)}) - {(c, w, s) for c, w, s in _ALL if c == "zero0-fp16"})


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict[str, list[float]], dict[tuple[str, int, int], dict[str, Any]], str]:
    root = str(tmp_path_factory.mktemp("deepspeed_saves"))
    theirs = run_distributed(save_and_continue, 2, "deepspeed", root, SAVED, timeout=600)[0]
    ours = {}
    for world in (1, 2, 4):
        loads = [(str(Path(root) / case), stage, resumed_precision(SAVED[case][1])) for case, w, stage in LOADS
                 if w == world]
        for (path, stage), result in run_distributed(resume, world, "shardwise", loads, timeout=600)[0].items():
            ours[(Path(path).name, world, stage)] = result
    return theirs, ours, root


@pytest.mark.parametrize("case,world,stage", LOADS, ids=[f"{c}-to-world{w}-stage{s}" for c, w, s in LOADS])
def test_deepspeed_checkpoint_resumes_with_deepspeeds_losses(runs, case, world, stage):
    theirs, ours, _ = runs
    result = ours[(case, world, stage)]
    assert result["case"] == case and result["global_steps"] == SAVED_AT + MORE
    if "fp16" in SAVED[case][1]:
        assert result["loss_scale"] == 2.0**8, "DeepSpeed's loss scale (2**8, no overflow) was not taken over"
    rtol = {"bf16": BF16_RTOL, "fp16": FP16_RTOL}.get(next(iter(SAVED[case][1]), ""), FP32_RTOL)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(theirs[case]), rtol=rtol, atol=0,
                               msg=lambda m: f"shardwise {result['losses']} vs DeepSpeed {theirs[case]}: {m}")


def _load_stage0_fp16(path: str) -> dict[str, str]:
    import shardwise
    from shardwise.checkpoint import CheckpointError

    model = make_model()
    engine, *_ = shardwise.initialize(model=model, model_parameters=param_groups(model),
                                      config=config({"stage": 0}, SAVED["zero0-fp16"][1], 1))
    try:
        engine.load_checkpoint(path)
    except CheckpointError as e:
        refused = str(e)
    _, client = engine.load_checkpoint(path, load_optimizer_states=False)  # the weights alone load
    return {"refused": refused, "case": client.get("case")}


def test_stage0_fp16_optimizer_state_is_refused(runs, tmp_path_factory):
    """DeepSpeed's FP16_Optimizer (stage 0, fp16) updates differently from its ZeRO optimizers; shardwise cannot
    continue its run from that state, so it refuses it and loads the weights when asked for them alone."""
    root = runs[2]
    result = run_distributed(_load_stage0_fp16, 1, str(Path(root) / "zero0-fp16"), timeout=300)[0]
    assert "saved at ZeRO stage 0 with fp16" in result["refused"] and "load_optimizer_states=False" in result["refused"]
    assert result["case"] == "zero0-fp16"


TP_SAVED_AT, TP_MORE = 2, 2


def _llama(name: str, root: str, tp: int) -> list[float]:
    """A tiny LLaMA (tests/tensor_parallel_models.py: SGD with momentum, clipped at every step). DeepSpeed at
    data-parallel size 2 and ZeRO-2 saves at step TP_SAVED_AT and goes on; shardwise at tensor-parallel size
    `tp` over the same world resumes from that save. The losses of the TP_MORE steps after it."""
    from tests import tensor_parallel_models as tpm

    world = int(os.environ["WORLD_SIZE"])
    if name == "deepspeed":
        import deepspeed as library

        library.init_distributed(dist_backend="gloo")
        config = {**{k: v for k, v in tpm.config(1, world, stage=2).items() if k != "tensor_parallel"},
                  "zero_allow_untested_optimizer": True}  # DeepSpeed asks for it with torch's SGD at ZeRO
    else:
        import shardwise as library

        config = tpm.config(tp, world // tp, stage=2)
    model = tpm.build("llama")
    if name == "shardwise":
        with torch.no_grad():  # other weights than the saved run started from: only the checkpoint can agree
            for p in model.parameters():
                p.add_(0.01)
    engine, *_ = library.initialize(model=model, model_parameters=[p for p in model.parameters()], config=config)
    if name == "deepspeed":
        _train_dp(engine, TP_SAVED_AT, 0)
        engine.save_checkpoint(root)
        return _train_dp(engine, TP_MORE, TP_SAVED_AT)
    engine.load_checkpoint(root)
    return tpm.train(engine, TP_MORE, TP_SAVED_AT)["losses"]


def _train_dp(engine: Any, steps: int, start: int) -> list[float]:
    """tests/tensor_parallel_models.train for DeepSpeed's engine (data parallelism only)."""
    import torch.distributed as dist

    from tests import tensor_parallel_models as tpm

    rank, world = dist.get_rank(), dist.get_world_size()
    micro = tpm.GLOBAL // world
    return [step_on(engine, tpm.loss_of(engine, tpm.batch(step)[rank * micro : (rank + 1) * micro]))
            for step in range(start, start + steps)]


def test_a_deepspeed_checkpoint_resumes_under_tensor_parallelism(tmp_path):
    """DeepSpeed (no tensor parallelism, ZeRO-2, 2 ranks) -> shardwise at tensor-parallel size 2: each rank
    cuts its part of every split parameter (and its moments) from the whole one, one parameter at a time."""
    theirs = run_distributed(_llama, 2, "deepspeed", str(tmp_path), 1, timeout=600)[0]
    ours = run_distributed(_llama, 2, "shardwise", str(tmp_path), 2, timeout=600)[0]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=0,
                               msg=lambda m: f"shardwise at tensor-parallel size 2 {ours} vs DeepSpeed {theirs}: {m}")
