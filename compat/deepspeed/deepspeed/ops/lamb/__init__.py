from shardwise.ops import FusedLamb

__all__ = ["FusedLamb"]
