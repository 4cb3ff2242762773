from shardwise.optim.lion import Lion as DeepSpeedCPULion
from shardwise.optim.lion import Lion as FusedLion

__all__ = ["DeepSpeedCPULion", "FusedLion"]
