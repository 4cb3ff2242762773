from shardwise.optim.lamb import Lamb as FusedLamb

__all__ = ["FusedLamb"]
