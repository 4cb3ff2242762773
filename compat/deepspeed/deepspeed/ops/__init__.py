"""`deepspeed.ops`: optimizers with DeepSpeed's constructors (shardwise.ops); shardwise builds no native ops."""

from . import adagrad, adam, lamb, lion

__all__ = ["adagrad", "adam", "lamb", "lion"]
