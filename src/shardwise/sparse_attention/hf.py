"""Hugging Face models on sparse attention: a function registered in transformers' attention registry
(`AttentionInterface`), which the model's own attention modules call in place of SDPA.

transformers 5 attention modules (GPT-2, LLaMA-family, BERT, ...) call
`ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, attention_mask, scaling=..., ...)`.
Registering a name there, and SDPA's mask builder under the same name in `AttentionMaskInterface` (so
padding reaches us as a boolean [batch, 1, q, k] keep-mask), then `model.set_attn_implementation(name)`
switches every layer without touching the model's modules or weights. The registry is transformers'
process-wide table; one name per distinct sparsity configuration is registered, each holding one
SparseSelfAttention (it keeps only the layout and BlockMask caches, so models may share it).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from torch import nn

from .attention import SparseAttentionInputError, SparseSelfAttention
from .layouts import SparsityConfig


class SparseModelError(ValueError):
    """A model that cannot be switched to sparse attention as asked."""


def is_causal_model(model: nn.Module) -> bool:
    """Whether the model's attention is causal (a decoder): a future token must never be seen."""
    return any(getattr(m, "is_causal", False) is True for m in model.modules()) or bool(
        getattr(getattr(model, "config", None), "is_decoder", False))


def check_direction(model: nn.Module, sparsity_config: SparsityConfig) -> None:
    attention = getattr(sparsity_config, "attention", "bidirectional")
    if is_causal_model(model) and attention != "unidirectional":
        raise SparseModelError(
            f"sparse_attention.attention: \"unidirectional\" is required for {type(model).__name__}, a causal model; "
            f"got {attention!r} ({type(sparsity_config).__name__}), which would let each token see later tokens. "
            "Set attention to \"unidirectional\".")


def _name(sparsity_config: SparsityConfig, max_position: int) -> str:
    settings = {k: v for k, v in vars(sparsity_config).items() if not k.startswith("_")}
    text = json.dumps([type(sparsity_config).__name__, settings, max_position], sort_keys=True, default=str)
    return "shardwise_sparse_" + hashlib.sha256(text.encode()).hexdigest()[:12]


def make_attention_function(sparse: SparseSelfAttention) -> Any:
    """The registry function: the HF module's q/k/v in, [batch, seq, heads, head_dim] out."""

    def sparse_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attention_mask: torch.Tensor | None, scaling: float | None = None,
                                 dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
        if dropout and module.training:
            raise SparseModelError(
                f"attention dropout: 0 is required with sparse attention (its kernels have no dropout); got {dropout} "
                f"in {type(module).__name__}. Set the model config's attention dropout (attn_pdrop, attention_dropout "
                "or attention_probs_dropout_prob) to 0.")
        if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
            raise SparseModelError(f"{type(module).__name__}: sliding_window/softcap attention cannot be combined with "
                                   "a sparsity layout; got one. Use the model's own attention for it.")
        if query.shape[2] != key.shape[2]:
            raise SparseAttentionInputError(
                f"key length: sparse attention is self-attention over the whole sequence ({query.shape[2]} queries); "
                f"got {key.shape[2]} keys (a key/value cache). Generate with use_cache=False, or switch the model back "
                "with model.set_attn_implementation(\"sdpa\") to generate.")
        if key.shape[1] != query.shape[1]:  # grouped-query attention: each key head serves several query heads
            repeat = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        mask = None
        if attention_mask is not None:
            mask = attention_mask[:, :, :, : key.shape[2]]
            mask = mask if mask.dtype == torch.bool else mask > -float("inf")  # an additive mask: -inf drops
        out = sparse(query, key, value, attn_mask=mask, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    return sparse_attention_forward


def require_hf_model(model: nn.Module) -> None:
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel) or getattr(model.config, "num_attention_heads", None) is None:
        raise SparseModelError(
            f"model: a transformers PreTrainedModel (with config.num_attention_heads) is required to switch its "
            f"attention to sparse attention; got {type(model).__name__}. Build shardwise.sparse_attention."
            "SparseSelfAttention into the model's attention yourself and pass the config without the "
            "sparse_attention block.")


def switch_to_sparse(model: nn.Module, sparsity_config: SparsityConfig, max_position: int) -> str:
    """Make `model` (a transformers PreTrainedModel) attend through SparseSelfAttention; returns the name."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    except ImportError as e:  # pragma: no cover - transformers is a test dependency here
        raise SparseModelError(f"transformers: needed to switch a Hugging Face model to sparse attention ({e}).") from e
    require_hf_model(model)
    heads = model.config.num_attention_heads
    if sparsity_config.num_heads != heads:
        raise SparseModelError(f"sparsity_config.num_heads: the model's num_attention_heads ({heads}) is required; "
                               f"got {sparsity_config.num_heads}.")
    check_direction(model, sparsity_config)
    name = _name(sparsity_config, max_position)
    sparse = SparseSelfAttention(sparsity_config, attn_mask_mode="mul", max_seq_length=max_position)
    AttentionInterface.register(name, make_attention_function(sparse))
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    if not model._can_set_attn_implementation():
        raise SparseModelError(f"model: {type(model).__name__} does not route attention through transformers' "
                               "AttentionInterface, so its attention cannot be switched; build SparseSelfAttention "
                               "into it yourself and pass the config without the sparse_attention block.")
    model.set_attn_implementation(name)
    return name
