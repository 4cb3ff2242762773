"""The out-of-memory explanation offers a change only if it fits by the account that judged the failure (planner/oom.py,
[Note: one account for the failure and the proposals]): the run ran out where its plan counted less than the capacity,
so every plan is scaled by capacity / that before it is judged. Crafted failure records, no engine."""

from __future__ import annotations

import dataclasses

from shardwise.config import parse_config
from shardwise.planner import ActivationProfile, ModelShape, plan
from shardwise.planner.changes import apply
from shardwise.planner.oom import FIT_SHARE, MemoryAtFailure, changes_that_fit, explain
from shardwise.profiling.memory import Bytes, MemoryBreakdown

MiB = 2**20
# A host failure seen in a real run: a 3.3M-parameter model (12.55 MiB in fp32) at micro-batch 64 under an address-space
# rlimit; its first forward failed having saved 192.63 MiB in a quarter of the modules, so the plans counted
# 770.5 MiB of activations at micro-batch 64. The plan of micro-batch 16 (243 MiB) was within 90% of the capacity
# (318 MiB) and failed again under the same limit; micro-batch 8 trained.
SHAPE = ModelShape(trainable=3_290_000, module_sizes=(65_536, 65_536, *(196_608, 65_536, 262_144, 262_144) * 4, 512))
RAW = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 64, "gradient_accumulation_steps": 1,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 0}}
STATES = 2 * 4 * SHAPE.trainable  # parameters and gradients; Adam's state comes at the first step
SAVED = int(192.63 * MiB)


HELD = MemoryBreakdown(Bytes(host=4 * SHAPE.trainable), Bytes(), Bytes(), Bytes(host=4 * SHAPE.trainable), Bytes(),
                       Bytes(), None, None, 497 * MiB, None)


def _host_failure() -> MemoryAtFailure:
    live = STATES + SAVED
    return MemoryAtFailure("forward of micro-step 1 (step 1)", 0, "cpu", HELD, live, int(100.67 * MiB),
                           "the address-space rlimit (ulimit -v)", ActivationProfile(SAVED * 4, 64),
                           "estimated: the failing first forward had saved 192.63 MiB in 25% of the modules holding "
                           "parameters", on_cpu=True, accounted=live)


def _planned(overrides: dict, facts: MemoryAtFailure) -> int:
    return plan(SHAPE, parse_config(apply(RAW, overrides), dp_size=1), 1, facts.activations).peak_total


def test_a_change_is_offered_only_if_it_fits_by_the_failures_account() -> None:
    facts = _host_failure()
    cfg = parse_config(RAW, dp_size=1)
    scale = facts.capacity / facts.accounted
    offered = list(changes_that_fit(cfg, 1, SHAPE, facts))
    assert offered
    for change, peak in offered:
        assert peak == _planned(change.overrides, facts)
        assert peak * scale <= FIT_SHARE * facts.capacity, (change.description, peak)
    micro16 = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 4}
    assert _planned(micro16, facts) <= FIT_SHARE * facts.capacity  # the bare plan would offer it
    assert all(c.overrides.get("train_micro_batch_size_per_gpu") != 16 for c, _ in offered)
    assert offered[0][0].overrides["train_micro_batch_size_per_gpu"] == 8
    got = explain(RuntimeError("DefaultCPUAllocator: can't allocate memory"), facts, cfg, 1, SHAPE)
    assert got.scale == scale and [c for c, _ in got.fitting] == [c for c, _ in offered[:len(got.fitting)]]
    assert (f"The run ran out of memory where its plan counts 217.73 MiB (the model states held and what the failing "
            f"first forward had saved): it needed at least {scale:.2f} times its plan") in got.text


def test_a_failure_the_plan_said_would_fit_scales_the_plans_by_its_peak() -> None:
    """A whole forward was measured, and the config's plan was within the capacity: the run needed more than the
    plan's peak, so a change must plan below 90% of that peak, not of the capacity."""
    acts = ActivationProfile(int(60 * MiB), 64)
    cfg = parse_config(RAW, dp_size=1)
    current = plan(SHAPE, cfg, 1, acts).peak_total
    capacity = int(current / 0.8)
    facts = MemoryAtFailure("backward of micro-step 1 (step 1)", 0, "cpu", HELD, capacity - 1024,
                            1024, "the address-space rlimit (ulimit -v)", acts, "measured over a whole forward",
                            on_cpu=True)
    got = explain(RuntimeError("DefaultCPUAllocator: can't allocate memory"), facts, cfg, 1, SHAPE)
    assert "The plan fits, so the memory went to something the planner does not count" in got.text
    assert got.fitting, got.text
    assert all(peak <= FIT_SHARE * current for _, peak in got.fitting), got.fitting
    assert got.scale == capacity / current
    stage1 = plan(SHAPE, parse_config(apply(RAW, {"zero_optimization.stage": 1}), dp_size=1), 1, acts).peak_total
    assert FIT_SHARE * current < stage1 <= FIT_SHARE * capacity  # fits the capacity, not the failure's account
    assert {"zero_optimization.stage": 1} not in [c.overrides for c, _ in got.fitting]


def test_a_plan_that_said_the_config_would_not_fit_leaves_the_plans_as_they_are() -> None:
    acts = ActivationProfile(int(770 * MiB), 64)
    facts = MemoryAtFailure("backward of micro-step 1 (step 1)", 0, "cpu", HELD, 300 * MiB,
                            10 * MiB, "the address-space rlimit (ulimit -v)", acts, "measured over a whole forward",
                            on_cpu=True)
    got = explain(RuntimeError("DefaultCPUAllocator: can't allocate memory"), facts, parse_config(RAW, dp_size=1), 1,
                  SHAPE)
    assert got.fitting and all(peak <= FIT_SHARE * facts.capacity for _, peak in got.fitting)
    assert "times its plan" not in got.text and getattr(got, "scale", 1.0) == 1.0


def test_under_an_address_space_limit_a_change_leaves_room_for_mappings_outside_the_allocator() -> None:
    """An address-space rlimit counts every mapping (malloc arenas, oneDNN's kernels), which no plan does: a change
    must leave `outside_allocator` of the capacity free as well as fit within FIT_SHARE of it."""
    plain = _host_failure()
    kept = dataclasses.replace(plain, outside_allocator=128 * MiB)
    cfg = parse_config(RAW, dp_size=1)
    scale = plain.capacity / plain.accounted
    offered = {tuple(sorted(c.overrides.items())): peak for c, peak in changes_that_fit(cfg, 1, SHAPE, plain)}
    crowded = {key for key, peak in offered.items() if peak * scale > plain.capacity - 128 * MiB}
    assert crowded and len(crowded) < len(offered), "the case must hold changes on both sides of the line"
    left = {tuple(sorted(c.overrides.items())) for c, _ in changes_that_fit(cfg, 1, SHAPE, kept)}
    assert left == set(offered) - crowded
    got = explain(RuntimeError("DefaultCPUAllocator: can't allocate memory"), kept, cfg, 1, SHAPE)
    assert got.fitting and got.fitting[0][0].overrides["train_micro_batch_size_per_gpu"] == 4, got.text  # 8 is crowded
    assert "leaves 128.00 MiB of it for mappings outside the tensor allocator" in got.text
