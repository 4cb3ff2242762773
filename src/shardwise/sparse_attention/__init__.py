"""Block-sparse attention with DeepSpeed's names: layouts (`layouts.py`), the attention module
(`attention.py`) on flex_attention, SDPA or, where flex has no backward, plain gathered blocks (`kernel.py`,
`block_gather.py`), BERT's sparse self-attention layer (`bert.py`), Hugging Face helpers (`utils.py`, `hf.py`)
and the config hook `initialize` calls (`apply.py`)."""

from .apply import apply_sparse_attention, sparsity_config_from
from .attention import SparseAttentionInputError, SparseSelfAttention
from .bert import BertSparseSelfAttention
from .layouts import (BigBirdSparsityConfig, BSLongformerSparsityConfig, DenseSparsityConfig, FixedSparsityConfig,
                      LocalSlidingWindowSparsityConfig, SparsityConfig, SparsityConfigError, VariableSparsityConfig)
from .utils import SparseAttentionUtils

__all__ = ["BertSparseSelfAttention", "BigBirdSparsityConfig", "BSLongformerSparsityConfig", "DenseSparsityConfig", "FixedSparsityConfig",
           "LocalSlidingWindowSparsityConfig", "SparseAttentionInputError", "SparseSelfAttention", "SparsityConfig",
           "SparseAttentionUtils", "SparsityConfigError", "VariableSparsityConfig", "apply_sparse_attention",
           "sparsity_config_from"]
