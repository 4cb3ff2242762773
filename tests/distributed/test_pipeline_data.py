"""Which micro-batches each train_batch / eval_batch call reads: exactly its own, fresh from its iterator, on 2
stages (world 2) against a single-process oracle that trains and evaluates the same micro-batches in the same
order. The first stage's inputs are recorded per call (a forward pre-hook), so a batch reused from an earlier call
shows even where the losses look plausible.

Micro-batches are delivered three ways: a fresh iterator per call, one iterator shared by every call (DeepSpeed
reads micro-batches from it in order, on the first and the last stage alike), and the engine's own loader
(initialize(training_data=...), train_batch() without data_iter, which advances it). "sticky": the first
train_batch is given an iterator and the later ones none; as in DeepSpeed the given iterator becomes the engine's,
so they read on from it, not from the engine's loader (given here with other data, so reading it would show).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tests import pipeline_models as pm
from tests.harness import run_distributed

MICRO, BLOCKS, LR, CALLS = 2, 2, 0.05, 4
EVAL_BASE = 100
"""Micro-batch indices of evaluation data that the engine's loader (training micro-batches 0...) never yields."""


@dataclass(frozen=True)
class Call:
    kind: str  # "train" or "eval"
    micro_batches: tuple[int, ...]
    """Indices into the micro-batch stream (`_micro_batch`), in the order the call reads them."""
    eval_kwargs: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class Case:
    name: str
    accum: int
    delivery: str  # "fresh", "shared", "loader" or "sticky"
    calls: tuple[Call, ...]


def _trains(accum: int, count: int = CALLS, start: int = 0) -> list[Call]:
    return [Call("train", tuple(range(start + i * accum, start + (i + 1) * accum))) for i in range(count)]


def _cases() -> list[Case]:
    cases = []
    for accum in (1, 2):
        for delivery in ("fresh", "shared", "loader"):
            cases.append(Case(f"{CALLS} train_batch, accumulation {accum}, {delivery}", accum, delivery,
                              tuple(_trains(accum))))
    cases.append(Case(f"{CALLS} train_batch, the first given the iterator", 1, "sticky", tuple(_trains(1))))
    # eval_batch of 1 micro-batch, then training of 2: eval's batch must not become training's first micro-batch
    for delivery in ("fresh", "shared"):
        calls = [Call("eval", (0,), (("num_micro_batches", 1),)), *_trains(2, 2, start=1)]
        cases.append(Case(f"eval 1 micro-batch then train, {delivery}", 2, delivery, tuple(calls)))
    # eval_batch between training steps, repeated with different batches: each gives its own batch's loss
    calls = [*_trains(2, 1), Call("eval", (2, 3)), Call("eval", (4, 5)),
             Call("eval", (6,), (("num_micro_batches", 1),)), *_trains(2, 1, start=7)]
    cases.append(Case("train, eval x3, train, shared", 2, "shared", tuple(calls)))
    cases.append(Case("train, eval x3, train, fresh", 2, "fresh", tuple(calls)))
    # evaluation with the engine's loader: eval reads its own iterator, the loader goes on where training left it
    calls = [*_trains(1, 1), Call("eval", (EVAL_BASE,), (("num_micro_batches", 1),)),
             Call("eval", (EVAL_BASE + 1,), (("num_micro_batches", 1),)), *_trains(1, 2, start=1)]
    cases.append(Case("train, eval x2, train x2, loader", 1, "loader", tuple(calls)))
    # without a loss the last stage still reads its micro-batches, as DeepSpeed's does, so a shared iterator stays
    # in step on both stages
    calls = [*_trains(2, 1), Call("eval", (2, 3), (("compute_loss", False),)), *_trains(2, 1, start=4)]
    cases.append(Case("eval without loss between trains, shared", 2, "shared", tuple(calls)))
    return cases


CASES = _cases()


def _micro_batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    return pm.global_batch(index, MICRO)


# --- on each rank -------------------------------------------------------------------------------------------------
def _run(case: Case) -> dict[str, Any]:
    import shardwise
    from shardwise.pipe import PipelineModule

    module = PipelineModule(pm.layer_specs(BLOCKS), num_stages=2, loss_fn=pm.loss_fn, seed_layers=True,
                            base_seed=pm.BASE_SEED)
    training_data = None
    if case.delivery == "loader":
        trained = [i for call in case.calls if call.kind == "train" for i in call.micro_batches]
        assert trained == list(range(len(trained)))  # the loader yields micro-batches 0, 1, ... in order
        training_data = [(x[r], y[r]) for x, y in map(_micro_batch, trained) for r in range(MICRO)]
    if case.delivery == "sticky":  # micro-batches no call reads: the loader must not be read
        training_data = [(x[r], y[r]) for x, y in map(_micro_batch, range(EVAL_BASE, EVAL_BASE + 8)) for r in range(MICRO)]
    config = pm.pipe_config(MICRO, case.accum, LR, collective_timeout_s=30)  # a stage left waiting fails, not hangs
    engine, _, _, _ = shardwise.initialize(model=module, model_parameters=module.parameters(), config=config,
                                           training_data=training_data)
    inputs: list[float] = []
    module.register_forward_pre_hook(lambda _, args: inputs.append(args[0].sum().item()))
    shared = iter([_micro_batch(i) for call in case.calls for i in call.micro_batches])
    per_call = []
    for call in case.calls:
        data = shared if case.delivery in ("shared", "sticky") else iter([_micro_batch(i) for i in call.micro_batches])
        before = len(inputs)
        if call.kind == "train":
            given = case.delivery == "sticky" and call is case.calls[0] or case.delivery not in ("loader", "sticky")
            out = engine.train_batch(data if given else None)
        else:
            out = engine.eval_batch(data, **dict(call.eval_kwargs))
        loss = out.item() if isinstance(out, torch.Tensor) and out.numel() == 1 else None
        per_call.append({"inputs": inputs[before:], "loss": loss})
    return {"stage": engine.stage_id, "calls": per_call, "left": sum(1 for _ in shared)}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, dict[str, Any]]]:
    return run_distributed(lambda: {case.name: _run(case) for case in CASES}, 2, timeout=240)


# --- the oracle -----------------------------------------------------------------------------------------------------
def _oracle(case: Case) -> list[dict[str, Any]]:
    """Each call's micro-batch input sums and loss, in one process: a train call is one SGD step on its
    micro-batches together (the mean of their losses), an eval call their loss at the current weights."""
    model = pm.Oracle(pm.layer_specs(BLOCKS))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    expected = []
    for call in case.calls:
        xs, ys = zip(*map(_micro_batch, call.micro_batches))
        x, y = torch.cat(xs), torch.cat(ys)
        if call.kind == "train":
            loss = pm.loss_fn(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        else:
            with torch.no_grad():
                loss = pm.loss_fn(model(x), y)
        compute_loss = dict(call.eval_kwargs).get("compute_loss", True)
        expected.append({"inputs": [t.sum().item() for t in xs], "loss": loss.item() if compute_loss else None})
    return expected


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_each_call_reads_its_own_micro_batches_and_matches_the_oracle(runs, case):
    first, last = sorted((per_rank[case.name] for per_rank in runs), key=lambda run: run["stage"])
    assert (first["stage"], last["stage"]) == (0, 1)
    expected = _oracle(case)
    assert len(expected) == len(first["calls"]) == len(last["calls"])
    for index, (want, got) in enumerate(zip(expected, first["calls"])):
        where = f"call {index} ({case.calls[index].kind})"
        assert got["inputs"] == pytest.approx(want["inputs"], rel=1e-6), f"{where}: stage 0 read other micro-batches"
        if want["loss"] is None:
            assert got["loss"] is None, where  # without a loss, eval_batch gives nothing on the first stage
            continue
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), where
        assert last["calls"][index]["loss"] == got["loss"], f"{where}: the stages report different losses"
    if case.delivery in ("shared", "sticky"):  # read to the end by both stages, each micro-batch once
        assert first["left"] == last["left"] == 0


def test_the_batches_differ_so_a_reused_batch_would_show():
    for case in CASES:
        indices = [i for call in case.calls for i in call.micro_batches]
        assert len(set(indices)) == len(indices), case.name
    sums = [_micro_batch(i)[0].sum().item() for i in range(8)]
    assert len({round(s, 4) for s in sums}) == len(sums)
