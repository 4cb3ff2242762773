"""CSV backend, in DeepSpeed's layout: one file per event under `<output_path>/<job_name>/`, named after
the event with "/" and spaces turned into "_", with the header `step,<last part of the name>`."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Sequence

from .base import Event


def csv_filename(name: str) -> str:
    return name.replace("/", "_").replace(" ", "_") + ".csv"


class CSVMonitor:
    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self._closed = False

    def write_events(self, events: Sequence[Event]) -> None:
        if self._closed:
            return
        for name, value, step in events:
            path = self.log_dir / csv_filename(name)
            new = not path.exists()
            with path.open("a", newline="") as f:
                writer = csv.writer(f)
                if new:
                    writer.writerow(["step", name.rsplit("/", 1)[-1]])
                writer.writerow([step, repr(float(value))])

    def close(self) -> None:
        self._closed = True
