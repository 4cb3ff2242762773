"""`deepspeed.ops`: optimizers with DeepSpeed's constructors (shardwise.optim.adam) and block-sparse attention
(shardwise.sparse_attention); shardwise builds no native ops (`transformer`'s fused layer refuses)."""

from . import adagrad, adam, lamb, lion, sparse_attention, transformer

__all__ = ["adagrad", "adam", "lamb", "lion", "sparse_attention", "transformer"]
