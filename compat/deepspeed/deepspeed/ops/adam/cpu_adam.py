from shardwise.ops import CPUAdam as DeepSpeedCPUAdam

__all__ = ["DeepSpeedCPUAdam"]
