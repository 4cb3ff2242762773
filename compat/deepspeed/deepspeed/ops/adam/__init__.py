from shardwise.optim.adam import CPUAdam as DeepSpeedCPUAdam
from shardwise.optim.adam import FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
