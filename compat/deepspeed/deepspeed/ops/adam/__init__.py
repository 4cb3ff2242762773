from shardwise.ops import CPUAdam as DeepSpeedCPUAdam
from shardwise.ops import FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
