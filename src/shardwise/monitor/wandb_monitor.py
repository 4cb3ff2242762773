"""Weights & Biases backend (optional: needs the `wandb` package and a logged-in account)."""

from __future__ import annotations

import importlib.util
from typing import Any, Sequence

from ..config.monitoring import WandbConfig
from .base import Event


def check_available() -> None:
    """Raise, on every rank alike, when wandb is enabled but not installed."""
    if importlib.util.find_spec("wandb") is None:
        raise ValueError("wandb.enabled: the wandb package is not installed; got enabled=true. "
                         "pip install wandb (and run `wandb login`), or set wandb.enabled to false.")


class WandbMonitor:
    def __init__(self, config: WandbConfig):
        import wandb

        self._wandb: Any = wandb
        self._run = wandb.init(project=config.project, group=config.group, entity=config.team)

    def write_events(self, events: Sequence[Event]) -> None:
        if self._run is None:
            return
        for name, value, step in events:
            self._wandb.log({name: value}, step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
