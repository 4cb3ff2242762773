from shardwise.sparse_attention.attention import SparseSelfAttention

__all__ = ["SparseSelfAttention"]
