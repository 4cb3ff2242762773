from shardwise.optim.adam import FusedAdam

__all__ = ["FusedAdam"]
