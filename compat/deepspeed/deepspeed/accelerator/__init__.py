"""`deepspeed.accelerator.get_accelerator()`: shardwise's accelerator object."""

from shardwise.accelerator import Accelerator as DeepSpeedAccelerator
from shardwise.accelerator import get_accelerator

__all__ = ["DeepSpeedAccelerator", "get_accelerator"]
