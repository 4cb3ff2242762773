from shardwise.sparse_attention.utils import SparseAttentionUtils

__all__ = ["SparseAttentionUtils"]
