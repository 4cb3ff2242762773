"""`SparseSelfAttention`: DeepSpeed's block-sparse self-attention module, on flex_attention, a block gather
or SDPA.

softmax(Q Kᵀ / √d + rpe + masks) V over the blocks the layout keeps; queries attend inside their own
diagonal block only to earlier keys when the layout is unidirectional. The layout is built once for
`max_seq_length` and cut to each sequence's block count, as DeepSpeed does, so a shorter sequence sees
the top-left corner of the long layout. The BlockMask (flex) and the BlockPlan (block gather) are built
once per (sequence length, device) and kept. See kernel.py for which path runs when.

Masks follow DeepSpeed's modes: "mul" treats the mask as keep (nonzero) / drop (zero); "add" adds its
values to the scores (e.g. 0 / -10000, or -inf). `key_padding_mask` is [batch, seq] (extra middle
dimensions of size 1 are allowed); `attn_mask` is [seq, seq] or anything that broadcasts to
[batch, heads, seq, seq]; `rpe` is added to the scores and broadcasts the same way.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
from torch import nn

from ..config.notes import note_once
from . import block_gather, kernel
from .layouts import SparsityConfig

logger = logging.getLogger("shardwise.sparse_attention")

MaskMode = Literal["add", "mul"]


class SparseAttentionInputError(ValueError):
    """A forward input SparseSelfAttention cannot compute (shape, length, mask)."""


class SparseSelfAttention(nn.Module):
    def __init__(self, sparsity_config: SparsityConfig | None = None, key_padding_mask_mode: MaskMode = "add",
                 attn_mask_mode: MaskMode = "mul", max_seq_length: int = 2048, backend: kernel.Backend = "auto") -> None:
        super().__init__()
        sparsity_config = sparsity_config if sparsity_config is not None else SparsityConfig(num_heads=4)
        for name, mode in (("key_padding_mask_mode", key_padding_mask_mode), ("attn_mask_mode", attn_mask_mode)):
            if mode not in ("add", "mul"):
                raise ValueError(f"{name}: \"add\" or \"mul\" is required; got {mode!r}.")
        if backend not in kernel.BACKENDS:
            raise ValueError(f"backend: one of {list(kernel.BACKENDS)} is required; got {backend!r}.")
        self.sparsity_config = sparsity_config
        self.key_padding_mask_mode = key_padding_mask_mode
        self.attn_mask_mode = attn_mask_mode
        self.max_seq_length = max_seq_length
        self.backend = backend
        # Not persistent: the layout is rebuilt from the config (seeded), so checkpoints stay the model's own.
        self.register_buffer("master_layout", sparsity_config.make_layout(max_seq_length), persistent=False)
        self.causal = getattr(sparsity_config, "attention", "bidirectional") == "unidirectional"
        self.dense = bool(self.master_layout.all())
        self._block_masks: dict[tuple[int, torch.device], object] = {}
        self._block_plans: dict[tuple[int, torch.device], block_gather.BlockPlan] = {}
        self._flex_failed: str | None = None

    def get_layout(self, seq_len: int) -> torch.Tensor:
        """The layout of a `seq_len`-token sequence: the top-left corner of the `max_seq_length` layout."""
        block = self.sparsity_config.block
        if seq_len % block != 0:
            raise SparseAttentionInputError(
                f"sequence length: must be a multiple of the sparsity block ({block}); got {seq_len}. Pad the inputs "
                f"with SparseAttentionUtils.pad_to_block_size({block}, ...) and cut the output with "
                "unpad_sequence_output.")
        if seq_len > self.max_seq_length:
            raise SparseAttentionInputError(
                f"sequence length: at most max_seq_length ({self.max_seq_length}) is required; got {seq_len}. Build "
                "SparseSelfAttention with a larger max_seq_length.")
        n = seq_len // block
        return self.master_layout[:, :n, :n]

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rpe: torch.Tensor | None = None,
                key_padding_mask: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                scale: float | None = None) -> torch.Tensor:
        """q, k, v: [batch, heads, seq, head_dim]; returns the same shape."""
        self._check_shapes(query, key, value)
        seq_len = query.shape[2]
        layout = self.get_layout(seq_len)
        masks = self._masks(query, rpe, key_padding_mask, attn_mask)
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        path = kernel.choose_backend(self.backend, query.device, kernel.needs_grad(query, key, value), self.dense)
        if path == "blocks":
            return block_gather.block_gather_path(query, key, value, self._block_plan(layout, seq_len), masks, scale)
        if path == "flex" and self._flex_failed is None:
            try:
                out = kernel.flex_path(query, key, value, self._block_mask(layout, seq_len), masks, scale)
                note_once(logger, logging.INFO, f"sparse attention: flex_attention (compiled) runs on {query.device.type}.")
                return out
            except Exception as e:  # noqa: BLE001 - any compile failure: see [Note: flex or SDPA] in kernel.py
                if self.backend == "flex":
                    raise
                self._flex_failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                note_once(logger, logging.WARNING, "sparse attention: flex_attention could not run "
                          f"({self._flex_failed}); the block gather runs instead.")
        if path == "flex" and not self.dense:  # flex failed: the block gather still computes only the layout's blocks
            return block_gather.block_gather_path(query, key, value, self._block_plan(layout, seq_len), masks, scale)
        keep = None if self.dense else kernel.layout_mask(layout, self.sparsity_config.block, self.causal)
        return kernel.sdpa_path(query, key, value, keep, self.causal, masks, scale)

    def _check_shapes(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if query.dim() != 4 or query.shape != key.shape or key.shape != value.shape:
            raise SparseAttentionInputError(
                f"query, key, value: three [batch, heads, seq, head_dim] tensors of one shape are required (self-"
                f"attention); got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}.")
        if query.shape[1] != self.sparsity_config.num_heads:
            raise SparseAttentionInputError(
                f"query: {self.sparsity_config.num_heads} heads (the sparsity config's num_heads) are required; got "
                f"{query.shape[1]} in shape {tuple(query.shape)}. Build the sparsity config with the model's heads.")

    def _block_mask(self, layout: torch.Tensor, seq_len: int) -> object:
        cache_key = (seq_len, layout.device)
        if cache_key not in self._block_masks:
            self._block_masks[cache_key] = kernel.block_mask_from_layout(
                layout, self.sparsity_config.block, self.causal, seq_len)
        return self._block_masks[cache_key]

    def _block_plan(self, layout: torch.Tensor, seq_len: int) -> block_gather.BlockPlan:
        cache_key = (seq_len, layout.device)
        if cache_key not in self._block_plans:
            self._block_plans[cache_key] = block_gather.build_plan(layout, self.sparsity_config.block, self.causal)
        return self._block_plans[cache_key]

    def _masks(self, query: torch.Tensor, rpe: torch.Tensor | None, key_padding_mask: torch.Tensor | None,
               attn_mask: torch.Tensor | None) -> kernel.Masks:
        batch, _, seq_len, _ = query.shape
        keep: torch.Tensor | None = None
        bias: torch.Tensor | None = None
        if rpe is not None:
            bias = rpe.to(query.dtype)
        parts = []
        if key_padding_mask is not None:
            padding = key_padding_mask.reshape(key_padding_mask.shape[0], -1)
            if padding.shape != (batch, seq_len):
                raise SparseAttentionInputError(
                    f"key_padding_mask: [batch, seq] = [{batch}, {seq_len}] is required; got {tuple(key_padding_mask.shape)}.")
            parts.append((padding[:, None, None, :], self.key_padding_mask_mode))
        if attn_mask is not None:
            parts.append((attn_mask, self.attn_mask_mode))
        for mask, mode in parts:
            if mode == "mul":
                kept = mask != 0
                keep = kept if keep is None else keep & kept
            else:
                added = mask.to(query.dtype)
                bias = added if bias is None else bias + added
        return kernel.Masks(keep=keep, bias=bias)
