"""Hugging Face models on Ulysses attention, the way DeepSpeed's `register_with_transformers` does it: the entry
of the model's own attention implementation in transformers' registry (`ALL_ATTENTION_FUNCTIONS["sdpa"]`, ...)
is replaced by `UlyssesAttention` around the original.

Replacing the entry rather than registering a new name keeps every branch transformers takes on the name
(mask construction, flash-attention's packed-sequence handling) as it was; the price is that the replacement is
process-wide, so it is recorded and `unregister_from_transformers` puts the original back.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .attention import UlyssesAttention, kv_replication
from .link import SequenceLink, SequenceParallelError

UNSUPPORTED_CORES = {
    "eager": "it needs the full seq × seq mask",
    "paged|eager": "it needs the full seq × seq mask",
    "flex_attention": "its block mask is built for the local shard",
}

_originals: dict[str, Any] = {}
"""Each replaced implementation's original function."""


def text_config(model: Any) -> Any:
    """The text part of a transformers model's (or config's) config."""
    config = model if hasattr(model, "model_type") else getattr(model, "config", None)
    if config is None:
        raise SequenceParallelError(
            f"model: a transformers model (with a .config) is required to switch its attention to Ulysses; got "
            f"{type(model).__name__}. Call shardwise.sequence_parallel.UlyssesAttention around your own attention.")
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def attention_implementation(model: nn.Module) -> str:
    return getattr(text_config(model), "_attn_implementation", None) or "eager"


def register_with_transformers(model: Any, link: SequenceLink, core_attn_implementation: str | None = None,
                               disable_in_eval: bool = False, tensor: int = 1) -> str:
    """Route the attention of `model` (a transformers model, or only its config) and of every model on the same
    implementation through Ulysses over `link`; returns the implementation's name. `tensor`: the tensor-parallel
    size, which has already divided the heads each rank sees."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = text_config(model)
    loaded = not hasattr(model, "model_type")  # a bare config still holds the unresolved default implementation
    active = attention_implementation(model)
    name = core_attn_implementation or active
    if loaded and name != active:
        raise SequenceParallelError(
            f"core_attn_implementation: {name!r} differs from the model's attn_implementation ({active!r}), so the "
            "wrapper would never be called; load the model with attn_implementation set to the same value.")
    if name in UNSUPPORTED_CORES:
        raise SequenceParallelError(
            f"attn_implementation: {name!r} cannot run under Ulysses sequence parallelism ({UNSUPPORTED_CORES[name]}); "
            "load the model with attn_implementation=\"sdpa\" (or a flash-attention variant).")
    if name not in _originals and name not in ALL_ATTENTION_FUNCTIONS:
        raise SequenceParallelError(f"attn_implementation: {name!r} is not in transformers' attention registry.")
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    # refuse head counts now, not at the first forward (tensor parallelism refuses what it cannot split itself)
    kv_replication(config.num_attention_heads // tensor, max(kv_heads // tensor, 1), link.size)
    core = _originals.setdefault(name, ALL_ATTENTION_FUNCTIONS[name])
    ALL_ATTENTION_FUNCTIONS[name] = UlyssesAttention(core, link, disable_in_eval)
    return name


def unregister_from_transformers() -> None:
    """Put every replaced attention implementation back."""
    if not _originals:
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name, core in _originals.items():
        ALL_ATTENTION_FUNCTIONS[name] = core
    _originals.clear()


def is_registered(name: str) -> bool:
    return name in _originals
