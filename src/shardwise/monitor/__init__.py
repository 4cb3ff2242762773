"""Where a run's figures go: one `Monitor` protocol, one backend per file (console, CSV, TensorBoard,
wandb), a fan-out that only global rank 0 fills, and `shardwise plot` for the CSV curves."""

from .base import Event, FanOut, Monitor
from .build import build_monitor, log_dir
from .reporter import StepFigures

__all__ = ["Event", "FanOut", "Monitor", "StepFigures", "build_monitor", "log_dir"]
