"""Builds the fan-out from the config: console always, then each enabled backend, on global rank 0 only."""

from __future__ import annotations

from pathlib import Path

from ..config import Config
from ..config.monitoring import FileMonitorConfig
from . import tensorboard_monitor, wandb_monitor
from .base import FanOut, Monitor
from .console import ConsoleMonitor
from .csv_monitor import CSVMonitor

DEFAULT_OUTPUT_PATH = "runs"


def log_dir(section: FileMonitorConfig) -> Path:
    """`<output_path>/<job_name>`; an empty output_path (DeepSpeed's default) means ./runs."""
    return Path(section.output_path or DEFAULT_OUTPUT_PATH) / section.job_name


def build_monitor(config: Config, rank: int) -> FanOut:
    # Checked on every rank, so a missing package fails all ranks alike instead of stranding rank 0.
    if config.tensorboard.enabled:
        tensorboard_monitor.check_available()
    if config.wandb.enabled:
        wandb_monitor.check_available()
    if rank != 0:
        return FanOut()
    backends: list[Monitor] = [ConsoleMonitor(config.train_batch_size)]
    if config.csv_monitor.enabled:
        backends.append(CSVMonitor(log_dir(config.csv_monitor)))
    if config.tensorboard.enabled:
        backends.append(tensorboard_monitor.TensorBoardMonitor(log_dir(config.tensorboard)))
    if config.wandb.enabled:
        backends.append(wandb_monitor.WandbMonitor(config.wandb))
    return FanOut(backends)
