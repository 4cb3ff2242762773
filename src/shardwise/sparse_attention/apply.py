"""The config hook: `initialize` hands the `sparse_attention` section here to switch the model's attention.

Only Hugging Face models can be switched from outside (their attention goes through transformers'
registry, hf.py); any other model is refused rather than trained dense while the config says sparse.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..config.sparse_attention import SparseAttentionConfig
from .hf import is_causal_model, require_hf_model, switch_to_sparse
from .layouts import (BigBirdSparsityConfig, BSLongformerSparsityConfig, DenseSparsityConfig, FixedSparsityConfig,
                      SparsityConfig, VariableSparsityConfig)

_CLASSES: dict[str, type[SparsityConfig]] = {
    "dense": DenseSparsityConfig, "fixed": FixedSparsityConfig, "variable": VariableSparsityConfig,
    "bigbird": BigBirdSparsityConfig, "bslongformer": BSLongformerSparsityConfig,
}
# DeepSpeed's config defaults (they differ from the classes' in one place: bigbird's num_random_blocks is 0).
_DEFAULTS: dict[str, Any] = {
    "num_local_blocks": 4, "num_global_blocks": 1, "attention": "bidirectional", "horizontal_global_attention": False,
    "num_different_global_patterns": 1, "num_random_blocks": 0, "local_window_blocks": [4],
    "global_block_indices": [0], "global_block_end_indices": None, "num_sliding_window_blocks": 3,
}


def sparsity_config_from(section: SparseAttentionConfig, num_heads: int, causal: bool = False) -> SparsityConfig:
    """The SparsityConfig a `sparse_attention` section describes, for `num_heads` heads. Dense mode has no
    `attention` key; it takes the model's direction (`causal`)."""
    from ..config.sparse_attention import MODE_KEYS

    kwargs: dict[str, Any] = {"block": section.block, "different_layout_per_head": section.different_layout_per_head}
    for key in MODE_KEYS[section.mode]:
        value = getattr(section, key)
        kwargs[key] = _DEFAULTS[key] if value is None else value
    if section.mode == "dense":
        kwargs["attention"] = "unidirectional" if causal else "bidirectional"
    if section.mode in ("variable", "bigbird"):
        kwargs["seed"] = section.seed
    return _CLASSES[section.mode](num_heads, **kwargs)


def apply_sparse_attention(model: nn.Module, section: SparseAttentionConfig | None) -> None:
    """Switch `model`'s attention as the config's `sparse_attention` section says (nothing if it has none)."""
    if section is None:
        return
    require_hf_model(model)
    config = model.config
    sparsity = sparsity_config_from(section, config.num_attention_heads, causal=is_causal_model(model))
    positions = getattr(config, "max_position_embeddings", None) or 2048
    switch_to_sparse(model, sparsity, -(-positions // section.block) * section.block)
