from shardwise.sparse_attention.layouts import (BigBirdSparsityConfig, BSLongformerSparsityConfig, DenseSparsityConfig,
                                                FixedSparsityConfig, LocalSlidingWindowSparsityConfig, SparsityConfig,
                                                VariableSparsityConfig)

__all__ = ["BigBirdSparsityConfig", "BSLongformerSparsityConfig", "DenseSparsityConfig", "FixedSparsityConfig",
           "LocalSlidingWindowSparsityConfig", "SparsityConfig", "VariableSparsityConfig"]
