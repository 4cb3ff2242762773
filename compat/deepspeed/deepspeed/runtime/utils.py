from shardwise.profiling.memory import see_memory_usage
from shardwise.runtime.data import move_to_device

__all__ = ["move_to_device", "see_memory_usage"]
