"""TensorBoard backend: scalars in an event file under `<output_path>/<job_name>/`, flushed per write."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Sequence

from .base import Event


def check_available() -> None:
    """Raise, on every rank alike, when the tensorboard package that torch's writer needs is missing."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ValueError("tensorboard.enabled: the tensorboard package is not installed; got enabled=true. "
                         "pip install tensorboard, or set tensorboard.enabled to false.")


class TensorBoardMonitor:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        self._writer: SummaryWriter | None = SummaryWriter(log_dir=str(log_dir))

    def write_events(self, events: Sequence[Event]) -> None:
        if self._writer is None:
            return
        for name, value, step in events:
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
