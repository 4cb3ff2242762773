from . import checkpointing

__all__ = ["checkpointing"]
