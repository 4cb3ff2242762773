"""`deepspeed.ops`: optimizers with DeepSpeed's constructors (shardwise.optim.adam) and block-sparse attention
(shardwise.sparse_attention); shardwise builds no native ops."""

from . import adagrad, adam, lamb, lion, sparse_attention

__all__ = ["adagrad", "adam", "lamb", "lion", "sparse_attention"]
