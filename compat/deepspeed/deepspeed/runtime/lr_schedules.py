"""`deepspeed.runtime.lr_schedules`: DeepSpeed's schedulers (shardwise.optim.schedulers)."""

from shardwise.optim.schedulers import SCHEDULERS, LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

VALID_LR_SCHEDULES = list(SCHEDULERS)

__all__ = ["LRRangeTest", "OneCycle", "VALID_LR_SCHEDULES", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]
