"""A live progress line on rank 0 (rich): optimizer step, loss, samples/s, elapsed and, with a known
total, a bar and the time left.

Off by default, since a user's script owns its terminal; examples and CLI runs switch it on with the
environment: `SHARDWISE_PROGRESS=1`, and `SHARDWISE_PROGRESS_TOTAL=<steps>` for a bar.
"""

from __future__ import annotations

import os
import time
from typing import Any

from .reporter import StepFigures

ENV_SWITCH, ENV_TOTAL = "SHARDWISE_PROGRESS", "SHARDWISE_PROGRESS_TOTAL"


def progress_from_env(rank: int) -> StepProgress | None:
    if rank != 0 or os.environ.get(ENV_SWITCH, "").lower() not in ("1", "true", "yes", "on"):
        return None
    total = os.environ.get(ENV_TOTAL)
    return StepProgress(int(total) if total else None)


class StepProgress:
    def __init__(self, total: int | None, console: Any = None):
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        columns = [TextColumn("step {task.completed}" + (f"/{total}" if total else "")), BarColumn(),
                   TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[rate]} samples/s"),
                   TimeElapsedColumn()]
        if total:
            columns.append(TimeRemainingColumn())
        self._progress = Progress(*columns, console=console or Console(stderr=True), auto_refresh=False)
        self._task = self._progress.add_task("train", total=total, loss="-", rate="-")
        self._progress.start()
        self._start = time.perf_counter()
        self._samples = 0

    def update(self, figures: StepFigures) -> None:
        self._samples += figures.batch
        rate = self._samples / max(time.perf_counter() - self._start, 1e-9)
        self._progress.update(self._task, completed=figures.step, loss=f"{float(figures.loss):.4f}", rate=f"{rate:,.1f}")
        self._progress.refresh()

    def close(self) -> None:
        self._progress.stop()
