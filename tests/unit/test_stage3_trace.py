"""ZeRO-3's execution trace: its indexed answers (upcoming units, reuse distance, later use) equal a plain
rescan of the recorded pass at every point of a pass, on random traces with repeated and persistent units."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from shardwise.zero.stage3.trace import ExecutionTrace


@dataclass(eq=False)
class FakeUnit:
    numel: int
    persistent: bool


def rescan_upcoming(events, cursor):
    return [u for _, units in events[cursor:] for u in units if not u.persistent]


def rescan_reused_within(events, cursor, unit, distance):
    if distance <= 0:
        return False
    seen = 0
    for other in (u for _, units in events[cursor:] for u in units):
        if other is unit:
            return True
        seen += other.numel
        if seen > distance:
            return False
    return False


@pytest.mark.parametrize("seed", range(5))
def test_indexed_trace_answers_like_a_rescan(seed):
    rng = random.Random(seed)
    units = [FakeUnit(rng.choice([10, 100, 1000]), rng.random() < 0.3) for _ in range(12)]
    events = [(("forward" if i < 20 else "backward", i), rng.sample(units, rng.randint(0, 3))) for i in range(40)]
    trace = ExecutionTrace()
    trace.start_pass(True)
    for event, used in events:  # the recording pass
        trace.record(event, used)
    trace.start_pass(True)  # the next pass follows the recorded one
    checked = 0
    for cursor, (event, used) in enumerate(events, start=1):
        trace.record(event, used)
        assert list(trace.upcoming()) == rescan_upcoming(events, cursor)
        later = [u for _, us in events[cursor:] for u in us]
        assert [trace.needed_later(u) for u in units] == [u in later for u in units]
        for unit in units:
            for distance in (0, 50, 500, 5000, 10**9):
                got = trace.reused_within(unit, distance)
                assert got == rescan_reused_within(events, cursor, unit, distance)
                checked += got
    assert checked > 100  # the traces do reuse units within these distances


def test_a_diverging_pass_stops_prefetching():
    a, b = FakeUnit(10, False), FakeUnit(10, False)
    trace = ExecutionTrace()
    trace.start_pass(True)
    trace.record(("forward", 1), [a])
    trace.record(("forward", 2), [b])
    trace.start_pass(True)
    trace.record(("forward", 1), [a])
    assert list(trace.upcoming()) == [b] and trace.reused_within(b, 100)
    trace.record(("forward", 3), [b])
    assert list(trace.upcoming()) == [] and not trace.reused_within(b, 100)


def _pass(trace, events):
    trace.start_pass(True)
    for event, used in events:
        trace.record(event, used)
    trace.commit()


def test_a_pass_that_follows_its_plan_keeps_it_and_any_change_replans():
    a, b, c = FakeUnit(10, False), FakeUnit(20, False), FakeUnit(30, False)
    events = [(("forward", 1), [a]), (("forward", 2), [b]), (("backward", 2), [b]), (("backward", 1), [a])]
    trace = ExecutionTrace()
    _pass(trace, events)
    plan = trace._traces[True]
    _pass(trace, events)
    assert trace._traces[True] is plan  # built once, not once per pass (~45 us of a small model's step)
    events[1][1].append(c)  # a module took an external parameter: its event's list grew in place
    trace.units_changed()
    _pass(trace, events)
    assert trace._traces[True] is not plan and c in trace._traces[True].fetchable
    plan = trace._traces[True]
    _pass(trace, events[:2])  # a pass that stopped early (no backward) is the plan from now on
    assert trace._traces[True] is not plan and len(trace._traces[True].events) == 2
    plan = trace._traces[True]
    _pass(trace, [events[1], events[0]])  # another order
    assert trace._traces[True].events == [("forward", 2), ("forward", 1)]
