"""A DeepSpeed pipeline run moved mid-way: DeepSpeed 0.19.8 trains a `PipelineModule` of 2 stages × 2
data-parallel ranks (world size 4, ZeRO-1) for 2 steps and saves (`layer_XX-model_states.pt`, one
`mp_rank_XX_model_states.pt` and its optimizer partitions per stage); shardwise resumes that checkpoint as a
PipelineModule of 2 stages at world size 2, and as the same layers in a plain `nn.Sequential` at world size 1
(the names agree: `<layer index>.<parameter>`), and its next 2 losses are those of DeepSpeed's uninterrupted run
within 1e-5 relative (fp32). The global batch (8 samples a step) is the same in every layout.

DeepSpeed is a reference here, never a dependency: `make test-deepspeed` runs this module in .dsvenv, or by hand:

    DS_ACCELERATOR=cpu PYTHONPATH=src:. .dsvenv/bin/python -m pytest tests/distributed/test_deepspeed_checkpoint_pipeline.py -q
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Iterator

import pytest
import torch
import torch.nn as nn

from tests.reference import real_deepspeed

real_deepspeed()  # imported once here so the forked ranks inherit it; skips in shardwise's own venv

from tests.harness import run_distributed  # noqa: E402

SAVED_AT, MORE, BATCH, MICRO = 2, 2, 8, 2


def _layers(library: Any) -> list[Any]:
    spec = library.pipe.LayerSpec
    return [nn.Linear(16, 32), nn.ReLU(), spec(nn.Linear, 32, 32), spec(nn.Tanh), spec(nn.Linear, 32, 4)]


def _samples(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 16, generator=g), torch.randint(0, 4, (BATCH,), generator=g)


def _micro_batches(first_step: int, dp_rank: int, dp: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This data-parallel rank's micro-batches, step after step: each step's 8 samples split over dp × accumulation."""
    step = first_step
    while True:
        x, y = _samples(step)
        for m in range(BATCH // (MICRO * dp)):
            at = (m * dp + dp_rank) * MICRO
            yield x[at : at + MICRO], y[at : at + MICRO]
        step += 1


def _config(dp: int) -> dict[str, Any]:
    return {"train_batch_size": BATCH, "train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0,
            "steps_per_print": 10_000, "zero_optimization": {"stage": 1},
            "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}


def _pipeline(name: str, root: str, save: bool) -> list[float]:
    """A PipelineModule of 2 stages over this world: DeepSpeed saving at SAVED_AT and going on, or shardwise
    resuming; the losses of the MORE steps after the save."""
    library = importlib.import_module(name)
    if name == "deepspeed":
        library.init_distributed(dist_backend="gloo")
    torch.manual_seed(0 if save else 1)  # the resumed run starts elsewhere: only the checkpoint can agree
    net = library.pipe.PipelineModule(layers=_layers(library), loss_fn=nn.CrossEntropyLoss(), num_stages=2,
                                      partition_method="uniform")
    world = int(os.environ["WORLD_SIZE"])  # set by the harness
    engine, *_ = library.initialize(model=net, config=_config(world // 2),
                                    model_parameters=[p for p in net.parameters() if p.requires_grad])
    grid = engine.grid
    data = _micro_batches(0 if save else SAVED_AT, grid.get_data_parallel_rank(), grid.get_data_parallel_world_size())
    if save:
        for _ in range(SAVED_AT):
            engine.train_batch(data_iter=data)
        engine.save_checkpoint(root)
    else:
        engine.load_checkpoint(root)
    return [float(engine.train_batch(data_iter=data)) for _ in range(MORE)]


def _sequential(root: str) -> list[float]:
    """The same layers as one nn.Sequential (names 0.weight ... 4.bias, as the pipeline's) on one rank."""
    import shardwise

    torch.manual_seed(1)
    body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))

    engine, *_ = shardwise.initialize(model=body, config={**_config(1), "train_micro_batch_size_per_gpu": BATCH})
    engine.load_checkpoint(root)
    losses = []
    for step in range(SAVED_AT, SAVED_AT + MORE):
        x, y = _samples(step)
        loss = nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[float]]:
    root = str(tmp_path_factory.mktemp("pipeline") / "saved")
    theirs = run_distributed(_pipeline, 4, "deepspeed", root, True, timeout=600)
    return {"deepspeed": theirs[-1],  # the last stage's loss (every stage reports it in both libraries)
            "shardwise-pipeline": run_distributed(_pipeline, 2, "shardwise", root, False, timeout=600)[-1],
            "shardwise-sequential": run_distributed(_sequential, 1, root, timeout=600)[0]}


@pytest.mark.parametrize("layout", ["shardwise-pipeline", "shardwise-sequential"])
def test_a_deepspeed_pipeline_checkpoint_resumes_with_its_losses(runs, layout):
    torch.testing.assert_close(torch.tensor(runs[layout]), torch.tensor(runs["deepspeed"]), rtol=1e-5, atol=0,
                               msg=lambda m: f"{layout} {runs[layout]} vs DeepSpeed {runs['deepspeed']}: {m}")
