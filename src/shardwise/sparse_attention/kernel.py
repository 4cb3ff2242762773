"""The attention computation over a block layout, three ways: `flex_attention` with a `BlockMask` (only the
layout's blocks are computed, compiled), a block gather in plain torch ops (block_gather.py: only the
layout's blocks, with autograd), or `F.scaled_dot_product_attention` with the layout expanded to a dense
boolean [S, S] mask (every score is computed, then masked).

[Note: flex or SDPA] flex_attention runs compiled (`torch.compile`; on CPU inductor builds C++ with the
system compiler). In torch 2.13 it has no backward on CPU ("FlexAttention does not support backward on
CPU"), so on CPU "auto" trains through the block gather ("blocks") and uses flex only when no gradient
is needed; on CUDA it always uses flex. A dense layout (every block kept) trains through SDPA instead
(without caller masks that is torch's own kernel, which holds no [S, S] scores). A flex compile that
fails (no C++ compiler, an inductor error) falls back in "auto" to the block gather (SDPA for a dense
layout) and raises in "flex". "blocks" and "sdpa" run on any device when asked for by name. All three give the same numbers (tests/unit/test_sparse_attention_kernel.py).

[Note: empty rows] A query that may attend to no key at all (a padded row, a row masked out by the
caller) gets an output of 0 on every path, as flex_attention gives; SDPA alone would give nan there,
and nan gradients with it, so those rows are unmasked for SDPA and their output replaced by 0.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from ..config.notes import note_once

logger = logging.getLogger("shardwise.sparse_attention")

Backend = Literal["auto", "flex", "blocks", "sdpa"]
BACKENDS = ("auto", "flex", "blocks", "sdpa")


@dataclass(frozen=True)
class Masks:
    """What the caller adds to the layout, already in kernel form: `keep` masks are bool (True: attend),
    `bias` tensors are added to the scaled scores; all broadcast against [batch, heads, q, k]."""

    keep: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    @property
    def empty(self) -> bool:
        return self.keep is None and self.bias is None


@functools.cache
def compiled_flex() -> Callable[..., torch.Tensor]:
    """One compiled flex_attention per process (compiling costs seconds; every module shares it)."""
    return torch.compile(flex_attention, dynamic=False)


def needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def choose_backend(backend: Backend, device: torch.device, grad: bool, dense: bool = False) -> str:
    """The path a call takes ("flex", "blocks" or "sdpa"); see [Note: flex or SDPA]."""
    if backend in ("sdpa", "blocks"):
        return backend
    if device.type == "cpu" and grad:
        if backend == "flex":
            raise ValueError("backend: \"flex\" cannot train on CPU (torch's flex_attention has no CPU backward); got "
                             "a call that needs gradients. Use backend \"auto\", \"blocks\" or \"sdpa\" on CPU.")
        if dense:
            return "sdpa"
        note_once(logger, logging.INFO, "sparse attention: the block gather runs (training on CPU, where "
                  "flex_attention has no backward).")
        return "blocks"
    return "flex"


def layout_mask(layout: torch.Tensor, block: int, causal: bool) -> torch.Tensor:
    """The layout [H, nb, nb] expanded to a boolean [H, S, S] token mask (causal inside blocks if asked)."""
    keep = layout.bool().repeat_interleave(block, 1).repeat_interleave(block, 2)
    if causal:
        keep = keep & torch.ones(keep.shape[-2:], dtype=torch.bool, device=keep.device).tril()
    return keep


def block_mask_from_layout(layout: torch.Tensor, block: int, causal: bool, seq_len: int) -> BlockMask:
    """A BlockMask listing each query block's key blocks, built from the layout alone (no [S, S] mask).

    Every listed block goes through `mask_mod` (the layout lookup and, if causal, q >= k): torch 2.13's CPU
    flex kernel fails to compile when "full" blocks (those that skip mask_mod) are given, and on CUDA the
    kernel tiles are 128 wide, so the layout is coarsened to tiles of at least 128 tokens there and a tile
    whose blocks are all kept and lie below the diagonal is marked full."""
    tile = block if layout.device.type == "cpu" else block * -(-128 // block)
    per_tile = tile // block
    heads, nb, _ = layout.shape
    nt = -(-nb // per_tile)
    padded = torch.zeros(heads, nt * per_tile, nt * per_tile, dtype=torch.bool, device=layout.device)
    padded[:, :nb, :nb] = layout.bool()
    tiles = padded.view(heads, nt, per_tile, nt, per_tile)
    any_kept = tiles.any(dim=(2, 4))
    full = torch.zeros_like(any_kept)
    if layout.device.type != "cpu":
        full = tiles.all(dim=(2, 4)) & (nt * per_tile * block == seq_len)
        if causal:
            full = full & torch.ones(nt, nt, dtype=torch.bool, device=layout.device).tril(-1)
    partial = any_kept & ~full
    keep_bool = layout.bool()

    def mask_mod(b: Any, h: Any, q: Any, k: Any) -> Any:
        kept = keep_bool[h, q // block, k // block]
        return kept & (q >= k) if causal else kept

    def indices(which: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        order = torch.argsort(which.to(torch.int8), dim=-1, descending=True, stable=True)
        return which.sum(-1).to(torch.int32)[None], order.to(torch.int32)[None]

    kv_num, kv_idx = indices(partial)
    full_num, full_idx = indices(full) if bool(full.any()) else (None, None)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=tile, mask_mod=mask_mod,
                                    seq_lengths=(seq_len, seq_len))


def flex_path(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: BlockMask, masks: Masks,
              scale: float) -> torch.Tensor:
    if query.device.type == "cpu":  # no gradient is needed here (choose_backend); flex refuses tensors that want one
        query, key, value = query.detach(), key.detach(), value.detach()
    score_mod = None
    if not masks.empty:
        shape = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        keep = masks.keep.expand(shape) if masks.keep is not None else None
        bias = masks.bias.expand(shape) if masks.bias is not None else None

        def score_mod(score: Any, b: Any, h: Any, q: Any, k: Any) -> Any:
            if bias is not None:
                score = score + bias[b, h, q, k]
            if keep is not None:
                score = torch.where(keep[b, h, q, k], score, -float("inf"))
            return score

    return compiled_flex()(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale)


def sdpa_path(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keep: torch.Tensor | None, causal: bool,
              masks: Masks, scale: float) -> torch.Tensor:
    """`keep` is the layout's [H, S, S] token mask, or None when the layout keeps every block."""
    if keep is None and masks.empty:  # dense: SDPA's own fast path
        return F.scaled_dot_product_attention(query, key, value, is_causal=causal, scale=scale)
    if keep is None:
        keep = layout_mask(torch.ones(1, 1, 1, dtype=torch.bool, device=query.device), query.shape[2], causal)
    if masks.keep is not None:
        keep = keep & masks.keep
    if masks.bias is not None:
        attn = masks.bias.to(query.dtype).masked_fill(~keep, -float("inf"))
        allowed = attn > -float("inf")
    else:
        attn, allowed = keep, keep
    empty = ~allowed.any(dim=-1, keepdim=True)  # see [Note: empty rows]
    if bool(empty.any()):
        attn = attn | empty if attn.dtype == torch.bool else attn.masked_fill(empty, 0.0)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attn, scale=scale)
        return out.masked_fill(empty, 0.0)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn, scale=scale)
