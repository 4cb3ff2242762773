"""DeepSpeed's communication-compressed optimizers: 1-bit Adam, 0/1 Adam and 1-bit LAMB (ZeRO stage 0)."""

from .adam import OneBitAdam
from .lamb import OneBitLamb
from .zero_one_adam import ZeroOneAdam

__all__ = ["OneBitAdam", "OneBitLamb", "ZeroOneAdam"]
