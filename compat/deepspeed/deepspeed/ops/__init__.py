"""`deepspeed.ops`: optimizers with DeepSpeed's constructors (shardwise.optim.adam); shardwise builds no native ops."""

from . import adagrad, adam, lamb, lion

__all__ = ["adagrad", "adam", "lamb", "lion"]
