from shardwise.optim.adam import CPUAdam as DeepSpeedCPUAdam

__all__ = ["DeepSpeedCPUAdam"]
