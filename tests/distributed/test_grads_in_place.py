"""[Note: gradients accumulate in place] (zero/grad_buckets.py): where a bucket persists and may be reduced twice,
each parameter's `.grad` is its slot during the engine's backward, so autograd adds into the bucket itself; outside
the window `.grad` is None. The training itself against the oracle is every stage's own test; here: where it
applies, and the two ways a window's `.grad` can differ from the slot (a gradient nobody adopted, and
`create_graph=True`) give the values the hooks' copies gave."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardwise
from tests.harness import run_distributed
from tests.parity import ds_config, make_model, micro_batch, param_groups


def _engine(stage: int, **extra):
    model = make_model()
    return shardwise.initialize(model=model, model_parameters=param_groups(model),
                                config=ds_config(2, 1, zero_optimization={"stage": stage}, **extra))[0]


def _in_flat(engine, tensor) -> bool:
    start = tensor.data_ptr()
    return any(b.flat is not None and b.flat.data_ptr() <= start < b.flat.data_ptr() + b.flat.nbytes
               for b in engine.strategy.buckets.buckets)


def _where_grads_go(stage: int, precision: dict):
    engine = _engine(stage, **precision)
    params = [p for p in engine.module.parameters() if p.requires_grad]
    seen = []
    for p in params:  # registered after the engine's hook: sees what it left
        p.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad is not None and _in_flat(engine, p.grad)))
    rank, world = dist.get_rank(), dist.get_world_size()
    engine.backward(engine(*micro_batch(0, 0, rank, 2, 1, world)))
    after = [p.grad is None for p in params]
    engine.step()
    return seen, all(after)


@pytest.mark.parametrize("stage,world,precision,in_place", [
    (0, 2, {}, True),                               # an all-reduce may run twice in a window
    (1, 2, {}, False),                              # a reduce-scatter may not ([Note: a bucket reduced twice ...])
    (2, 2, {}, False),                              # partitioned buckets come and go
    (2, 1, {}, True), (3, 1, {}, True),             # alone: whole buckets, stage 3's parameters whole
    (0, 1, {"bf16": {"enabled": True}}, False),     # 16-bit parameters, fp32 buckets
])
def test_where_gradients_accumulate(stage, world, precision, in_place):
    for seen, cleared in run_distributed(_where_grads_go, world, stage, precision):
        assert seen and all(s is in_place for s in seen), seen
        assert cleared  # nothing is left in .grad once engine.backward returns


def _window_by_hand(case: str):
    """The strategy's window driven directly (as the pipeline engine does): a gradient already in `.grad` that no
    one adopted, or a backward with create_graph=True. The slots must hold what the hooks' copies held."""
    engine = _engine(0)
    weight = engine.module.hidden.weight
    tokens, labels = micro_batch(0, 0, 0, 2, 1, 1)
    reference = make_model()
    reference(tokens, labels).backward()
    expected = reference.hidden.weight.grad.clone()
    if case == "unadopted":
        weight.grad = torch.ones_like(weight)
        expected += 1
    engine.strategy.begin_backward(True)
    engine(tokens, labels).backward(create_graph=case == "create_graph")
    engine.strategy.finish_backward()
    bucket, i = next((b, i) for b in engine.strategy.buckets.buckets for i, p in enumerate(b.params) if p is weight)
    return bucket.slot_view(i).view_as(weight).detach().clone(), expected, weight.grad


@pytest.mark.parametrize("case", ["unadopted", "create_graph"])
def test_a_window_whose_grad_is_not_its_slot_counts_each_gradient_once(case):
    slot, expected, left = run_distributed(_window_by_hand, 1, case)[0]
    torch.testing.assert_close(slot, expected, rtol=1e-6, atol=1e-7)
    assert left is None
