from shardwise.optim.adam import CPUAdagrad as DeepSpeedCPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]
