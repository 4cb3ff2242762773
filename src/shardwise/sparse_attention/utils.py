"""`SparseAttentionUtils`: DeepSpeed's helpers for running Hugging Face models on sparse attention: pad a
batch to a whole number of blocks and cut the output back, grow a BERT-style absolute position table,
and switch a model's attention (hf.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .hf import SparseModelError, switch_to_sparse
from .layouts import SparsityConfig


class SparseAttentionUtils:
    @staticmethod
    def extend_position_embedding(model: nn.Module, max_position: int) -> nn.Module:
        """Grow a BERT/RoBERTa absolute position table to `max_position` rows by repeating the trained rows
        (RoBERTa's first 2 rows are its padding offset and stay in place)."""
        embeddings = _absolute_position_embeddings(model)
        old = embeddings.position_embeddings.weight
        offset = 2 if model.config.model_type in ("roberta", "xlm-roberta", "camembert") else 0
        if max_position <= old.shape[0]:
            raise SparseModelError(f"max_position: more than the current table ({old.shape[0]} rows) is required; got "
                                   f"{max_position}.")
        new = old.new_empty(max_position + offset, old.shape[1])
        trained = old[offset:]
        with torch.no_grad():
            new[:offset] = old[:offset]
            for start in range(offset, new.shape[0], trained.shape[0]):
                rows = min(trained.shape[0], new.shape[0] - start)
                new[start:start + rows] = trained[:rows]
        table = nn.Embedding(new.shape[0], new.shape[1], padding_idx=embeddings.position_embeddings.padding_idx)
        table.weight = nn.Parameter(new)
        embeddings.position_embeddings = table
        embeddings.position_ids = torch.arange(new.shape[0], device=old.device).expand((1, -1))
        if hasattr(embeddings, "token_type_ids"):
            embeddings.token_type_ids = torch.zeros(embeddings.position_ids.size(), dtype=torch.long, device=old.device)
        model.config.max_position_embeddings = new.shape[0]
        return model

    @staticmethod
    def update_tokenizer_model_max_length(tokenizer: Any, max_position: int) -> Any:
        tokenizer.model_max_length = max_position
        tokenizer.init_kwargs["model_max_length"] = max_position
        return tokenizer

    @staticmethod
    def replace_model_self_attention_with_sparse_self_attention(
            model: nn.Module, max_position: int, sparsity_config: SparsityConfig | None = None) -> nn.Module:
        """Every attention layer of a transformers model attends through SparseSelfAttention (layouts built
        for `max_position` tokens); default: DeepSpeed's default of a bidirectional Fixed layout."""
        if sparsity_config is None:
            from .layouts import FixedSparsityConfig

            sparsity_config = FixedSparsityConfig(num_heads=model.config.num_attention_heads)
        switch_to_sparse(model, sparsity_config, max_position)
        return model

    @staticmethod
    def pad_to_block_size(block_size: int, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                          token_type_ids: torch.Tensor | None, position_ids: torch.Tensor | None,
                          inputs_embeds: torch.Tensor | None, pad_token_id: int,
                          model_embeddings: nn.Module | None) -> tuple[int, Any, Any, Any, Any, Any]:
        """Right-pad every input to a multiple of `block_size`: (pad_len, input_ids, attention_mask,
        token_type_ids, position_ids, inputs_embeds). Padded keys get attention_mask 0; padded inputs_embeds
        are the embedding of `pad_token_id` (from `model_embeddings`, a module called on token ids)."""
        reference = input_ids if input_ids is not None else inputs_embeds
        if reference is None:
            raise ValueError("input_ids / inputs_embeds: one is required; got neither.")
        batch, seq_len = reference.shape[:2]
        pad_len = (block_size - seq_len % block_size) % block_size
        if pad_len == 0:
            return 0, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds
        pad = lambda t, value: None if t is None else nn.functional.pad(t, (0, pad_len), value=value)  # noqa: E731
        if inputs_embeds is not None:
            if model_embeddings is None:
                raise ValueError("model_embeddings: needed to embed the padding of inputs_embeds; got None. Pass the "
                                 "model's input embeddings (e.g. model.get_input_embeddings()).")
            ids = inputs_embeds.new_full((batch, pad_len), pad_token_id, dtype=torch.long)
            inputs_embeds = torch.cat([inputs_embeds, model_embeddings(ids)], dim=1)
        if attention_mask is None:
            attention_mask = torch.ones(batch, seq_len, dtype=torch.long, device=reference.device)
        return (pad_len, pad(input_ids, pad_token_id), pad(attention_mask, 0), pad(token_type_ids, 0),
                pad(position_ids, pad_token_id), inputs_embeds)

    @staticmethod
    def unpad_sequence_output(pad_len: int, sequence_output: torch.Tensor) -> torch.Tensor:
        """The model output without the `pad_len` positions pad_to_block_size added."""
        return sequence_output[:, :-pad_len] if pad_len > 0 else sequence_output


def _absolute_position_embeddings(model: nn.Module) -> nn.Module:
    base = getattr(model, getattr(model, "base_model_prefix", ""), model)
    embeddings = getattr(base, "embeddings", None)
    if embeddings is None or not isinstance(getattr(embeddings, "position_embeddings", None), nn.Embedding):
        raise SparseModelError(
            f"model: a BERT/RoBERTa-style model with an absolute position table (embeddings.position_embeddings) is "
            f"required; got {type(model).__name__}. Models with rotary or relative positions need no extension: "
            "pass max_position to replace_model_self_attention_with_sparse_self_attention only.")
    return embeddings
