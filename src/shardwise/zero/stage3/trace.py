"""The order in which units are needed, recorded on one pass and used to prefetch on the next.

A pass starts at the root module's forward and runs through its backward. Every hook event (a
module's forward, or its backward) is recorded with the units it needs. When the next pass of the same
kind (with or without gradients) follows the recorded order, the units of upcoming events are
gathered ahead of time; at the first divergence prefetching stops for the rest of that pass, and the
new order is recorded instead. Every rank runs the same model code, so every rank prefetches the same
units in the same order and the collectives line up.
"""

from __future__ import annotations

import logging
from typing import Iterator

from .unit import ParamUnit

logger = logging.getLogger(__name__)

Event = tuple[str, int]  # ("forward" | "backward", id of the module)


class ExecutionTrace:
    def __init__(self) -> None:
        self._traces: dict[bool, list[tuple[Event, list[ParamUnit]]]] = {}
        self._recording: list[tuple[Event, list[ParamUnit]]] = []
        self._expected: list[tuple[Event, list[ParamUnit]]] | None = None
        self._mode = True
        self._cursor = 0
        self._warned = False

    def start_pass(self, grad_enabled: bool) -> None:
        self.commit()
        self._mode = grad_enabled
        self._expected = self._traces.get(grad_enabled)
        self._cursor = 0

    def commit(self) -> None:
        if self._recording:
            self._traces[self._mode] = self._recording
        self._recording = []

    def record(self, event: Event, units: list[ParamUnit]) -> None:
        self._recording.append((event, units))
        if self._expected is None:
            return
        if self._cursor < len(self._expected) and self._expected[self._cursor][0] == event:
            self._cursor += 1
            return
        if not self._warned:
            logger.info("ZeRO-3: module order differs from the recorded pass; prefetching paused until re-recorded.")
            self._warned = True
        self._expected = None

    def upcoming(self) -> Iterator[ParamUnit]:
        """Units of the events after the current one, in order (empty when not following a trace)."""
        if self._expected is None:
            return
        for _, units in self._expected[self._cursor :]:
            yield from units

    def reused_within(self, unit: ParamUnit, distance: int) -> bool:
        """Whether `unit` is needed again before `distance` elements of other units are gathered."""
        if distance <= 0:
            return False
        seen = 0
        for other in self.upcoming():
            if other is unit:
                return True
            seen += other.numel
            if seen > distance:
                return False
        return False
