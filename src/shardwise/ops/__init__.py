"""Optimizers usable on their own, with DeepSpeed's constructors: `CPUAdam` (DeepSpeedCPUAdam), `FusedAdam`,
`CPUAdagrad` (DeepSpeedCPUAdagrad), `FusedLamb` (DeepSpeed's FusedLamb = `shardwise.optim.lamb.Lamb`)."""

from ..optim.lamb import Lamb as FusedLamb
from .adam import CPUAdagrad, CPUAdam, FusedAdam

__all__ = ["CPUAdagrad", "CPUAdam", "FusedAdam", "FusedLamb"]
