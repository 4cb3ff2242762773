from shardwise.runtime.data import DistributedLoader as DeepSpeedDataLoader
from shardwise.runtime.data import RepeatingLoader

__all__ = ["DeepSpeedDataLoader", "RepeatingLoader"]
