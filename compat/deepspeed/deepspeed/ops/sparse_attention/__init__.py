"""`deepspeed.ops.sparse_attention`: block-sparse attention (shardwise.sparse_attention, on flex_attention)."""

from shardwise.sparse_attention import (BertSparseSelfAttention, BigBirdSparsityConfig, BSLongformerSparsityConfig,
                                        DenseSparsityConfig, FixedSparsityConfig, LocalSlidingWindowSparsityConfig,
                                        SparseAttentionUtils, SparseSelfAttention, SparsityConfig,
                                        VariableSparsityConfig)

__all__ = ["BertSparseSelfAttention", "BigBirdSparsityConfig", "BSLongformerSparsityConfig", "DenseSparsityConfig",
           "FixedSparsityConfig", "LocalSlidingWindowSparsityConfig", "SparseAttentionUtils", "SparseSelfAttention",
           "SparsityConfig", "VariableSparsityConfig"]
