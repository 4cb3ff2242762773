from shardwise.accelerator import get_accelerator

__all__ = ["get_accelerator"]
