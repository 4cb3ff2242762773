"""What a pipeline engine refuses, with the message a user sees: calls it does not take, configurations it
cannot run, and bad batches, which fail the stage that reads them with their cause and the stage waiting on it
with a communication error naming that rank (never a hang). And the documented way past a changed activation
shape: engine.reset_activation_shape()."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from tests import pipeline_models as pm
from tests.harness import run_distributed

MICRO, ACCUM, LR = 2, 4, 0.05


# --- refusals --------------------------------------------------------------------------------------------------
def _attempt(call) -> tuple[str, str] | None:
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the test asserts the type and message
        return type(e).__name__, str(e)
    return None


def _refusals() -> dict[str, tuple[str, str] | None]:
    import shardwise
    from shardwise.pipe import PipelineModule

    config = pm.pipe_config(MICRO, ACCUM, LR)
    got = {"zero-3": _attempt(lambda: pm.pipe_run(2, {**config, "zero_optimization": {"stage": 3}}, 0))}
    engine = pm.pipe_run(2, config, 0)["engine"]
    x, _ = next(pm.micro_batches(0, MICRO, ACCUM, 0, 1))
    got["engine(x)"] = _attempt(lambda: engine(x))
    got["backward"] = _attempt(lambda: engine.backward(torch.zeros((), requires_grad=True)))
    got["step"] = _attempt(engine.step)
    with torch.no_grad():
        got["no_grad"] = _attempt(lambda: engine.train_batch(pm.micro_batches(0, MICRO, ACCUM, 0, 1)))
    got["no data"] = _attempt(engine.train_batch)
    engine.set_dataiterator(pm.micro_batches(0, MICRO, ACCUM, 0, 1))  # training's: eval_batch must not read it
    got["eval without data_iter"] = _attempt(lambda: engine.eval_batch(None))
    got["3 stages on 2 ranks"] = _attempt(lambda: PipelineModule(pm.layer_specs(), num_stages=3, loss_fn=pm.loss_fn))
    got["stages differ"] = _attempt(lambda: pm.pipe_run(2, {**config, "pipeline": {"stages": 4}}, 0))
    got["plain module"] = _attempt(lambda: shardwise.initialize(model=torch.nn.Linear(2, 2),
                                                                config={**config, "pipeline": {"stages": 2}}))
    interleaved = {**config, "pipeline": {"schedule": "interleaved_1f1b"}}
    got["interleaved, 1 chunk"] = _attempt(lambda: pm.pipe_run(2, interleaved, 0))
    got["2 chunks, 1f1b"] = _attempt(lambda: pm.pipe_run(2, config, 0, num_chunks=2))
    for name, (layers, method) in PARAMETER_FREE_STAGES.items():
        got[name] = _attempt(lambda: PipelineModule(layers(), num_stages=2, partition_method=method))
    return got


def _two_linears_then_activations() -> list[Any]:
    from shardwise.pipe import LayerSpec

    return [LayerSpec(torch.nn.Linear, pm.IN, pm.WIDTH), LayerSpec(torch.nn.Linear, pm.WIDTH, pm.OUT),
            LayerSpec(torch.nn.ReLU), torch.tanh]


def _one_linear_then_activations() -> list[Any]:
    from shardwise.pipe import LayerSpec

    return [LayerSpec(torch.nn.Linear, pm.IN, pm.OUT), *[LayerSpec(torch.nn.ReLU) for _ in range(3)]]


# name: (the layers, partition_method). By parameters, the first gets [0, 1, 4] (a fix), the second [0, 3, 4] and the
# third [0, 2, 3] (no fix); uniformly, [0, 2, 4], [0, 2, 4] and [0, 2, 3]
PARAMETER_FREE_STAGES = {
    "parameter-free stage, uniform": (_two_linears_then_activations, "uniform"),
    "parameter-free stage, any method": (_one_linear_then_activations, "parameters"),
    "only a tied copy on a stage": (lambda: pm.layer_specs(blocks=1, tied=True), "uniform"),
}


REFUSALS = {
    "zero-3": ("ValueError", (
        "zero_optimization.stage: pipeline parallelism runs with ZeRO stages 0, 1 and 2; stage 3 is not supported "
        "with a PipelineModule yet.")),
    "engine(x)": ("PipelineError", (
        "a pipeline engine runs forward inside train_batch() / eval_batch(); call those instead of engine(...)")),
    "backward": ("PipelineError", (
        "engine.backward(): a pipeline engine runs backward inside train_batch(); call train_batch(data_iter) once "
        "per optimizer step.")),
    "step": ("PipelineError", (
        "engine.step(): a pipeline engine steps inside train_batch(); call train_batch(data_iter) once per optimizer "
        "step.")),
    "no_grad": ("PipelineError", "train_batch(): gradients are disabled (inside torch.no_grad())"),
    "no data": ("PipelineError", "train_batch(): no data on stage"),
    "eval without data_iter": ("PipelineError", (
        "; pass data_iter (an iterator of (inputs, labels) micro-batches to evaluate): the training iterator is not "
        "read for evaluation.")),
    "3 stages on 2 ranks": ("ValueError", (
        "num_stages (3) must divide the world size (2): the ranks split into data-parallel replicas of the whole "
        "pipeline.")),
    "stages differ": ("ConfigError", (
        'pipeline.stages: 4 differs from the PipelineModule\'s num_stages (2); make them equal or set "auto".')),
    "plain module": ("ConfigError", "pipeline.stages: 2 pipeline stages need a PipelineModule model; got a Linear."),
    "interleaved, 1 chunk": ("ValueError", (
        'pipeline.schedule: "interleaved_1f1b" needs a PipelineModule with num_chunks >= 2')),
    "2 chunks, 1f1b": ("ValueError", (
        'pipeline.schedule: "1f1b" runs one model chunk per stage, but the PipelineModule has num_chunks=2')),
    "parameter-free stage, uniform": ("ValueError", (
        'PipelineModule: pipeline stage 1 holds no parameters: partition_method "uniform" gave it no layer with '
        "parameters of its own (layers 2: ReLU, 3: tanh), so its optimizer would have nothing to train. Use "
        'partition_method "parameters", which puts parameters on every stage of this model')),
    "parameter-free stage, any method": ("ValueError", (
        'PipelineModule: pipeline stage 1 holds no parameters: partition_method "parameters" gave it no layer with '
        "parameters of its own (layers 3: ReLU), so its optimizer would have nothing to train. Neither "
        '"parameters" nor "uniform" puts parameters on every one of the 2 stages of this model: use "type:<regex>"')),
    "only a tied copy on a stage": ("ValueError", (
        'PipelineModule: pipeline stage 1 holds no parameters: partition_method "uniform" gave it no layer with '
        "parameters of its own (layers 2: Linear tied as 'embed', a parameter of stage 0 only)")),
}


def test_refusals_name_what_to_change():
    per_rank = run_distributed(_refusals, 2, timeout=120)
    for got in per_rank:
        assert got.keys() == REFUSALS.keys()
        for name, (kind, message) in REFUSALS.items():
            assert got[name] is not None, f"{name}: nothing was refused"
            assert got[name][0] == kind and message in got[name][1], f"{name}: {got[name]}"


def _bad_batch(kind: str) -> tuple[tuple[str, str] | None, dict[str, Any]]:
    """One good batch (the stages agree on [MICRO, WIDTH] activations), then a bad one. The peer's wait is
    bounded by collective_timeout_s; it fails sooner, when the failed rank's process group closes."""
    config = pm.pipe_config(MICRO, ACCUM, LR, collective_timeout_s=20)
    engine = pm.pipe_run(2, config, 1)["engine"]
    batches = {
        "not a pair": lambda: iter([(x, y, x) for x, y in pm.micro_batches(1, MICRO, ACCUM, 0, 1)]),
        "ran out": lambda: itertools.islice(pm.micro_batches(1, MICRO, ACCUM, 0, 1), 2),
        "shape changed": lambda: pm.micro_batches(1, MICRO + 1, ACCUM, 0, 1),
    }
    return _attempt(lambda: engine.train_batch(batches[kind]())), {"stage": engine.stage_id}


BAD_BATCHES = {
    "not a pair": ("PipelineError", (
        "a pipeline micro-batch must be a pair (inputs, labels); got a tuple of 3. Yield (inputs, labels) from the "
        "data iterator.")),
    "ran out": ("PipelineError", (
        "the data iterator ran out at micro-batch 2; a batch needs 4 micro-batches (gradient_accumulation_steps).")),
    "shape changed": ("ValueError", (
        "pipeline stage 0, chunk 0, micro-batch 0: the output is [float32[3, 16]] but the stages agreed on "
        "[float32[2, 16]] at the first micro-batch; every micro-batch must have the same shapes")),
}


@pytest.mark.parametrize("kind", BAD_BATCHES)
def test_a_bad_batch_fails_the_first_stage_with_its_cause_and_the_other_stage_too(kind):
    (first, _), (last, info) = run_distributed(_bad_batch, 2, kind, timeout=120)
    assert info["stage"] == 1
    assert first is not None and first[0] == BAD_BATCHES[kind][0] and BAD_BATCHES[kind][1] in first[1], first
    # the last stage waited on the first: a communication error naming it, not a hang
    assert last is not None and last[0] in ("CollectiveError", "CollectiveTimeout"), last
    assert "[rank 1/2, pipe group]" in last[1] and "rank 0" in last[1], last


def _reset_then_wider() -> float:
    """A batch of MICRO rows per micro-batch, then reset_activation_shape() on every rank and one of MICRO + 1."""
    engine = pm.pipe_run(2, pm.pipe_config(MICRO, ACCUM, LR), 1)["engine"]
    engine.reset_activation_shape()
    return engine.train_batch(pm.micro_batches(1, MICRO + 1, ACCUM, 0, 1)).item()


def test_reset_activation_shape_lets_the_next_batch_change_shape():
    model = pm.Oracle(pm.layer_specs())
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step, micro in enumerate((MICRO, MICRO + 1)):
        x, y = pm.global_batch(step, micro * ACCUM)
        loss = pm.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert run_distributed(_reset_then_wider, 2, timeout=120) == [pytest.approx(loss.item(), rel=1e-5)] * 2
