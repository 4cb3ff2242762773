"""The out-of-memory explanation (planner/oom.py) from given facts: which changes it proposes, that each one's
planned peak really fits the capacity, and what it says when nothing does. The real failure inside the
engine is tests/distributed/test_out_of_memory.py."""

from __future__ import annotations

import pytest

from shardwise.config import parse_config
from shardwise.planner import ActivationProfile, ModelShape, plan
from shardwise.planner.changes import Change, apply, parsed, single_changes
from shardwise.planner.oom import FIT_SHARE, MemoryAtFailure, changes_that_fit, explain
from shardwise.profiling.memory import Bytes, MemoryBreakdown

GiB = 2**30
# A 1B-parameter model in 24 layers of ~40M elements, with a 50M embedding.
SHAPE = ModelShape(trainable=1_010_000_000, module_sizes=(50_000_000, *(40_000_000,) * 24, 10_000))
ACTS = ActivationProfile(saved_bytes=12 * GiB, micro_batch=8, compute_bytes=2)
RAW = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": True},
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 1}}


def _facts(capacity: int, host_capacity: int | None = None, activations: ActivationProfile | None = ACTS) -> MemoryAtFailure:
    nothing = Bytes()
    held = MemoryBreakdown(nothing, nothing, nothing, nothing, nothing, nothing, None, None, 0, None)
    return MemoryAtFailure("backward of micro-step 1 (step 1)", 0, "cuda:0", held, capacity - 1024, 1024,
                           "free on the device plus torch's unused cache", activations, "measured over a whole forward",
                           on_cpu=False, host_capacity=host_capacity)


def _explain(capacity: int, world: int = 4, **kwargs: object):
    cfg = parse_config(RAW, dp_size=world)
    return explain(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), _facts(capacity, **kwargs), cfg,
                   world, SHAPE)


def test_every_proposed_change_plans_within_the_capacity_and_the_current_config_does_not() -> None:
    capacity = 20 * GiB
    current = plan(SHAPE, RAW, 4, ACTS).peak_device
    assert current > capacity  # ZeRO 1, bf16, micro 8 on 4 ranks: ~29 GiB
    got = _explain(capacity)
    assert got.fitting, got.text
    for change, peak in got.fitting:
        changed = parse_config(apply(RAW, change.overrides), dp_size=4)
        assert plan(SHAPE, changed, 4, ACTS).peak_device == peak <= FIT_SHARE * capacity
        assert changed.train_batch_size == 64  # none of them changes what is trained
    text = got.text
    assert "out of memory on cuda:0 in the backward of micro-step 1 (step 1): CUDA out of memory" in text
    assert "The plan of this config" in text and "activations" in text and "optimizer state" in text
    assert f"  - {got.fitting[0][0].description}:" in text


def test_cheaper_changes_come_first_and_the_batch_is_held() -> None:
    got = _explain(20 * GiB)
    first = got.fitting[0][0]
    assert first.overrides == {"zero_optimization.stage": 2}  # a higher stage before a smaller micro-batch
    micro = [c for c, _ in got.fitting if "train_micro_batch_size_per_gpu" in c.overrides]
    assert micro and all(c.overrides["train_micro_batch_size_per_gpu"] * c.overrides["gradient_accumulation_steps"]
                         * 4 == 64 for c in micro)


def test_pairs_of_changes_when_no_single_one_fits() -> None:
    got = _explain(9 * GiB)
    assert got.fitting and all("; " in change.description for change, _ in got.fitting), got.text


def test_offload_to_the_host_is_only_proposed_when_the_host_can_hold_it() -> None:
    def offloads(host_capacity: int) -> list[Change]:
        facts = _facts(20 * GiB, host_capacity=host_capacity)
        return [c for c, _ in changes_that_fit(parse_config(RAW, dp_size=4), 4, SHAPE, facts)
                if c.overrides.get("zero_optimization.offload_optimizer.device") == "cpu"]

    assert offloads(host_capacity=200 * GiB)
    assert not offloads(host_capacity=1 * GiB)


def test_nothing_fits_names_the_ranks_that_would() -> None:
    text = _explain(5 * GiB, world=1).text
    assert "No single change or pair of changes fits. At ZeRO stage 3 with a micro-batch of 1 over 32 ranks" in text  # the window: 2 GiB of layers
    assert "add ranks, or a device with more memory" in text
    hopeless = _explain(GiB // 8, world=1).text
    assert "No change fits, not even ZeRO stage 3 with a micro-batch of 1 over 64 times the ranks" in hopeless


def test_without_activations_the_plans_count_model_states_only() -> None:
    text = _explain(20 * GiB, activations=None).text
    assert "activations: unknown (the failure came before the first forward saved any)" in text


def test_single_changes_are_all_accepted_by_the_parser_or_dropped() -> None:
    cfg = parse_config({**RAW, "zero_optimization": {"stage": 0}}, dp_size=4)
    changes = list(single_changes(cfg, 4))
    kept = [c for c in changes if parsed(RAW | {"zero_optimization": {"stage": 0}}, c, 4) is not None]
    # stage 0 cannot offload the optimizer (the parser says so): that change is dropped, the rest stand
    assert {"zero_optimization.offload_optimizer.device": "cpu"} in [c.overrides for c in changes]
    assert {"zero_optimization.offload_optimizer.device": "cpu"} not in [c.overrides for c in kept]
    assert [c.overrides["zero_optimization.stage"] for c in kept[:3]] == [1, 2, 3]


@pytest.mark.parametrize("overrides, expected", [
    ({"zero_optimization.stage": 3}, {"zero_optimization": {"stage": 3}}),
    ({"zero_optimization.offload_param.device": "cpu"}, {"zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"}}}),
])
def test_apply_sets_dotted_keys_and_leaves_the_original(overrides: dict, expected: dict) -> None:
    raw = {"zero_optimization": {"stage": 1}}
    assert apply(raw, overrides) == expected
    assert raw == {"zero_optimization": {"stage": 1}}


def test_what_other_engines_hold_is_named_and_left_out_of_the_capacity() -> None:
    facts = MemoryAtFailure("forward of micro-step 1 (step 1)", 0, "cuda:0", _facts(GiB).held, 18 * GiB, 2 * GiB,
                            "free on the device plus torch's unused cache", ACTS, "measured over a whole forward",
                            on_cpu=False, other_engines=40 * GiB)
    assert facts.capacity == 20 * GiB
    text = explain(RuntimeError("CUDA out of memory."), facts, parse_config(RAW, dp_size=4), 4, SHAPE).text
    assert "Capacity: 20.00 GiB per rank (18.00 GiB live at the failure + 2.00 GiB still free, bound by free on the " \
           "device plus torch's unused cache; the 40.00 GiB other engines hold on this device is left out)" in text
