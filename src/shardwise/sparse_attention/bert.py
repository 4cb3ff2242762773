"""`BertSparseSelfAttention`: DeepSpeed's stand-alone BERT self-attention layer on SparseSelfAttention
(query/key/value projections from a BERT config, the sparse kernel between them)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .attention import SparseSelfAttention
from .layouts import FixedSparsityConfig, SparsityConfig


class BertSparseSelfAttention(nn.Module):
    def __init__(self, config: Any, sparsity_config: SparsityConfig | None = None) -> None:
        super().__init__()
        if config.hidden_size % config.num_attention_heads != 0:
            raise ValueError(f"hidden_size: a multiple of num_attention_heads ({config.num_attention_heads}) is "
                             f"required; got {config.hidden_size}.")
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        sparsity_config = sparsity_config or FixedSparsityConfig(num_heads=config.num_attention_heads)
        self.sparse_self_attention = SparseSelfAttention(
            sparsity_config, max_seq_length=getattr(config, "max_position_embeddings", 2048))

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:2], self.num_attention_heads, self.attention_head_size).transpose(1, 2)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """hidden_states [batch, seq, hidden]; attention_mask: the key padding mask (added, as DeepSpeed's)."""
        q, k, v = (self._heads(proj(hidden_states)) for proj in (self.query, self.key, self.value))
        context = self.sparse_self_attention(q, k, v, key_padding_mask=attention_mask)
        return context.transpose(1, 2).reshape(*hidden_states.shape[:2], -1)
