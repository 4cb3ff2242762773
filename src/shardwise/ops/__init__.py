"""Optimizer kernels usable on their own: `shardwise.ops.CPUAdam` (DeepSpeedCPUAdam's interface)."""

from .cpu_adam import CPUAdam

__all__ = ["CPUAdam"]
