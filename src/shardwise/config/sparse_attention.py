"""`sparse_attention`: DeepSpeed's (pre-0.19.8) block-sparse attention section: a `mode` and that mode's keys.

Each mode reads its own keys (DeepSpeed's `get_sparse_*_config`); a key of another mode is refused with
the mode's list rather than ignored. Unset keys take DeepSpeed's config defaults when the layout is built
(`shardwise.sparse_attention.apply.sparsity_config_from`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .base import Section

Mode = Literal["dense", "fixed", "variable", "bigbird", "bslongformer"]
Direction = Literal["bidirectional", "unidirectional"]

COMMON_KEYS = ("mode", "block", "different_layout_per_head", "enabled")
MODE_KEYS: dict[str, tuple[str, ...]] = {
    "dense": (),
    "fixed": ("num_local_blocks", "num_global_blocks", "attention", "horizontal_global_attention",
              "num_different_global_patterns"),
    "variable": ("num_random_blocks", "local_window_blocks", "global_block_indices", "global_block_end_indices",
                 "attention", "horizontal_global_attention"),
    "bigbird": ("num_random_blocks", "num_sliding_window_blocks", "num_global_blocks", "attention"),
    "bslongformer": ("num_sliding_window_blocks", "global_block_indices", "global_block_end_indices", "attention"),
}


class SparseAttentionConfig(Section):
    """Block-sparse attention for a Hugging Face model, switched on at `initialize`."""

    enabled: bool = True
    """(shardwise) false drops the section, as for other DeepSpeed sections."""
    mode: Mode = "fixed"
    block: int = Field(16, ge=1)
    different_layout_per_head: bool = False
    num_local_blocks: int | None = Field(None, ge=1)
    num_global_blocks: int | None = Field(None, ge=0)
    attention: Direction | None = None
    horizontal_global_attention: bool | None = None
    num_different_global_patterns: int | None = Field(None, ge=1)
    num_random_blocks: int | None = Field(None, ge=0)
    local_window_blocks: list[int] | None = None
    global_block_indices: list[int] | None = None
    global_block_end_indices: list[int] | None = None
    num_sliding_window_blocks: int | None = Field(None, ge=1)
    seed: int = 0
    """(shardwise) the seed of the random blocks (variable, bigbird); every rank builds the same layout."""

    @model_validator(mode="after")
    def _keys_of_mode(self) -> SparseAttentionConfig:
        allowed = set(COMMON_KEYS) | set(MODE_KEYS[self.mode]) | ({"seed"} if self.mode in ("variable", "bigbird") else set())
        foreign = sorted(k for k in self.model_fields_set if k not in allowed)
        if foreign:
            raise ValueError(
                f"sparse_attention.{foreign[0]}: not a key of mode {self.mode!r} (its keys: "
                f"{', '.join(MODE_KEYS[self.mode]) or 'none beyond block and different_layout_per_head'}); got "
                f"{', '.join(foreign)}. Remove {'it' if len(foreign) == 1 else 'them'} or change mode.")
        return self
