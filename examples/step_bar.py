"""The examples' progress bar (rich, which shardwise itself draws its progress line and tables with):
step n/N, a bar, the script's own figures, elapsed and remaining time.

Lines printed with :meth:`StepBar.write`, and the log lines of the root and ``shardwise`` loggers, appear
above the bar instead of breaking it. A disabled bar (ranks other than 0) draws nothing.
"""

from __future__ import annotations

import logging
import sys
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

_LOGGERS = ("", "shardwise")  # the root logger and shardwise's own (which does not propagate)


class StepBar:
    def __init__(self, total: int, initial: int = 0, description: str = "step", enabled: bool = True,
                 console: Console | None = None):
        self._progress = Progress(
            TextColumn(description), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[figures]}"),
            TimeElapsedColumn(), TimeRemainingColumn(), console=console or Console(stderr=True), disable=not enabled,
        )
        self._task = self._progress.add_task(description, total=total, completed=initial, figures="")
        self._streams: list[tuple[logging.StreamHandler, Any]] = []

    def __enter__(self) -> StepBar:
        self._progress.start()
        # While the bar is live on a terminal, rich replaces sys.stderr with a stream that prints above it;
        # handlers made before that still hold the real stream, so point them at the replacement.
        for name in _LOGGERS:
            for handler in logging.getLogger(name).handlers:
                if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.__stderr__, sys.__stdout__):
                    old = handler.setStream(sys.stderr)  # None when nothing was replaced (not a terminal)
                    if old is not None:
                        self._streams.append((handler, old))
        return self

    def update(self, **figures: str) -> None:
        """One more step; `figures` (name=text) replace the ones shown."""
        text = "  ".join(f"{name} {value}" for name, value in figures.items())
        self._progress.update(self._task, advance=1, figures=text)

    def write(self, line: str) -> None:
        if not self._progress.disable:
            self._progress.console.print(line, markup=False, highlight=False)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._progress.stop()
        for handler, stream in self._streams:
            handler.setStream(stream)
        self._streams.clear()
