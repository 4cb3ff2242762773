"""The Monitor protocol every backend implements, and the fan-out the engine writes to.

An event is `(name, value, step)`. The engine's own events follow DeepSpeed's names
("Train/Samples/train_loss", ...) with the number of samples trained so far as the step, so
dashboards built for DeepSpeed runs read shardwise runs unchanged. Only global rank 0 writes: on every
other rank the fan-out holds no backend and creates no file.
"""

from __future__ import annotations

from typing import Iterable, Protocol, Sequence, runtime_checkable

Event = tuple[str, float, int]


@runtime_checkable
class Monitor(Protocol):
    def write_events(self, events: Sequence[Event]) -> None:
        """Record each `(name, value, step)`."""

    def close(self) -> None:
        """Flush and release files; later writes are dropped."""


class FanOut:
    """Writes every event to each backend; `enabled` is false when there is none (e.g. on ranks > 0)."""

    def __init__(self, backends: Iterable[Monitor] = ()):
        self.backends = list(backends)

    @property
    def enabled(self) -> bool:
        return bool(self.backends)

    def write_events(self, events: Sequence[Event]) -> None:
        if not self.backends:
            return
        events = [(str(name), float(value), int(step)) for name, value, step in events]
        for backend in self.backends:
            backend.write_events(events)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()
