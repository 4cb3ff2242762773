from shardwise.ops import FusedAdam

__all__ = ["FusedAdam"]
