"""The order in which units are needed, recorded on one pass and used to prefetch on the next.

A pass starts at the root module's forward and runs through its backward. Every hook event (a
module's forward, or its backward) is recorded with the units it needs. When the next pass of the same
kind (with or without gradients) follows the recorded order, the units of upcoming events are
gathered ahead of time; at the first divergence prefetching stops for the rest of that pass, and the
new order is recorded instead. Every rank runs the same model code, so every rank prefetches the same
units in the same order and the collectives line up.
"""

from __future__ import annotations

import bisect
import itertools
import logging
from typing import Iterator

from .unit import ParamUnit

logger = logging.getLogger(__name__)

Event = tuple[str, int]  # ("forward" | "backward", id of the module)


class _Plan:
    """A recorded pass indexed for the questions asked at every hook: which gatherable units come next, and
    how far away a unit's next use is. Built once per pass, so each answer is a slice or a bisection rather
    than a rescan of the rest of the trace (which made a pass quadratic in its number of events)."""

    def __init__(self, events: list[tuple[Event, list[ParamUnit]]]):
        self.events = [event for event, _ in events]
        self.start: list[int] = []  # event index -> position of its first unit in the flattened pass
        self.fetchable_start: list[int] = []  # the same in the list of non-persistent units
        self.fetchable: list[ParamUnit] = []
        self.prefix = [0]  # numel of the flattened pass's units before each position
        self.uses: dict[int, list[int]] = {}  # id(unit) -> its positions, ascending
        for _, units in events:
            self.start.append(len(self.prefix) - 1)
            self.fetchable_start.append(len(self.fetchable))
            for unit in units:
                self.uses.setdefault(id(unit), []).append(len(self.prefix) - 1)
                self.prefix.append(self.prefix[-1] + unit.numel)
                if not unit.persistent:
                    self.fetchable.append(unit)
        self.start.append(len(self.prefix) - 1)
        self.fetchable_start.append(len(self.fetchable))


class ExecutionTrace:
    def __init__(self) -> None:
        self._traces: dict[bool, _Plan] = {}
        self._recording: list[tuple[Event, list[ParamUnit]]] = []
        self._expected: _Plan | None = None
        self._mode = True
        self._cursor = 0
        self._warned = False
        self._stale = False
        self.passes = 0

    def start_pass(self, grad_enabled: bool) -> None:
        self.passes += 1
        self.commit()
        self._mode = grad_enabled
        self._expected = self._traces.get(grad_enabled)
        self._cursor = 0

    def commit(self) -> None:
        if not self._recording:
            return
        plan = self._expected
        followed = plan is not None and self._cursor == len(plan.events) == len(self._recording) and not self._stale
        if not followed:  # a pass that followed its plan to the end leaves it as it was
            self._traces[self._mode] = _Plan(self._recording)
        self._recording = []
        self._stale = False

    def units_changed(self) -> None:
        """An event's list of units grew (a module took an external parameter): the next commit re-plans."""
        self._stale = True

    def record(self, event: Event, units: list[ParamUnit]) -> None:
        self._recording.append((event, units))
        if self._expected is None:
            return
        if self._cursor < len(self._expected.events) and self._expected.events[self._cursor] == event:
            self._cursor += 1
            return
        if not self._warned:
            logger.info("ZeRO-3: module order differs from the recorded pass; prefetching paused until re-recorded.")
            self._warned = True
        self._expected = None

    def upcoming(self) -> Iterator[ParamUnit]:
        """Non-persistent units of the events after the current one, in order (empty when not following a
        trace); persistent units are never released, so there is nothing to prefetch for them."""
        plan = self._expected
        if plan is None:
            return iter(())
        return itertools.islice(plan.fetchable, plan.fetchable_start[self._cursor], None)

    def needed_later(self, unit: ParamUnit) -> bool:
        """Whether `unit` is used by an event after the current one of the pass being followed."""
        plan = self._expected
        if plan is None:
            return False
        uses = plan.uses.get(id(unit))
        return uses is not None and uses[-1] >= plan.start[self._cursor]

    def reused_within(self, unit: ParamUnit, distance: int) -> bool:
        """Whether `unit` is needed again before `distance` elements of other units are gathered."""
        plan = self._expected
        if distance <= 0 or plan is None:
            return False
        here = plan.start[self._cursor]
        uses = plan.uses.get(id(unit), ())
        i = bisect.bisect_left(uses, here)
        return i < len(uses) and plan.prefix[uses[i]] - plan.prefix[here] <= distance
