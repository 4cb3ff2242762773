"""Block-sparse attention in plain torch ops: gather each query block's key/value blocks, attend over them.

The third path of kernel.py (see [Note: flex or SDPA] there): it computes only the layout's blocks, like
flex_attention, but through ordinary differentiable ops, so it trains where flex has no backward (CPU in
torch 2.13). Memory grows with the number of kept blocks times block², not with seq².

[Note: block buckets] Query block rows differ in how many key blocks they attend (a global row attends
all of them, a local row a few). Padding every row to the widest one would make a single global row cost
as much as dense attention, so rows are grouped by their count, rounded up to a width with three significant
bits (1..8, 10, 12, 14, 16, 20, 24, 28, 32, 40, ...: under 1/4 padding, at most four groups per doubling),
and each group is one batched gather + matmul.

[Note: recompute in backward] Saving every group's gathered K/V and probabilities for the backward would
hold three copies of the kept scores at once (measured: 4.3 GiB for `fixed` at 16k tokens, 8 heads, block 64).
So when gradients are needed, each group's rows go in chunks of about CHUNK_BYTES of intermediates, each
chunk under non-reentrant activation checkpointing: the forward keeps only the chunk's output, and the
backward recomputes one chunk at a time (fixed at 16k: 2.7 GiB). The price is one more forward of the
attention, as flash attention pays; the peak is the inputs, their gradients and one chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch.utils.checkpoint import checkpoint

from .kernel import Masks, needs_grad


CHUNK_BYTES = 16 * 2**20
"""Intermediates (gathered K/V, scores, probabilities) of one recomputed chunk; see [Note: recompute in backward]."""


@dataclass(frozen=True)
class Bucket:
    """Query block rows of one width. Rows are flat indices g * nb + i over the plan's layout groups."""

    rows: torch.Tensor  # [n] long
    key_blocks: torch.Tensor  # [n, width] long, flat like rows; padding points at block 0 of the group
    head: torch.Tensor  # [n] long: the layout group g of each row
    row_block: torch.Tensor  # [n] long: i
    col_block: torch.Tensor  # [n, width] long: j
    allowed: torch.Tensor  # [n, block, width * block] bool: kept block, not padding, causal inside


@dataclass(frozen=True)
class BlockPlan:
    """Everything a call needs that depends on the layout alone; built once per (sequence length, device).
    `groups` is 1 when every head has the same layout (the heads then share the plan), else the head count."""

    groups: int
    num_blocks: int
    block: int
    buckets: tuple[Bucket, ...]
    inverse: torch.Tensor  # [groups * nb] long: position of each flat row in the buckets' concatenated output


def bucket_width(count: int) -> int:
    """`count` rounded up to three significant bits; see [Note: block buckets]."""
    count = max(count, 1)
    step = 1 << max(count.bit_length() - 3, 0)
    return -(-count // step) * step


def build_plan(layout: torch.Tensor, block: int, causal: bool) -> BlockPlan:
    """The plan of a layout [H, nb, nb] (0/1); `causal` drops blocks above the diagonal (they keep nothing)."""
    keep = layout.bool()
    if bool((keep == keep[:1]).all()):
        keep = keep[:1]
    groups, nb, _ = keep.shape
    if causal:
        keep = keep & torch.ones(nb, nb, dtype=torch.bool, device=keep.device).tril()
    keep = keep.reshape(groups * nb, nb)
    counts = keep.sum(-1).tolist()
    widths = torch.tensor([min(bucket_width(c), nb) for c in counts], device=keep.device)
    # Kept key blocks first, in ascending order (stable sort), then the dropped ones as padding.
    key_order = torch.argsort(keep.to(torch.int8), dim=-1, descending=True, stable=True)
    count_t = torch.tensor(counts, device=keep.device)
    offsets = torch.arange(block, device=keep.device)
    buckets, order = [], []
    for width in sorted(set(widths.tolist())):
        rows = torch.nonzero(widths == width).flatten()
        head, row_block = rows // nb, rows % nb
        col_block = key_order[rows, :width]
        valid = torch.arange(width, device=keep.device) < count_t[rows, None]
        q_pos = row_block[:, None] * block + offsets  # [n, block]
        k_pos = (col_block[:, :, None] * block + offsets).flatten(1)  # [n, width * block]
        allowed = valid.repeat_interleave(block, 1)[:, None, :].expand(-1, block, -1)
        if causal:
            allowed = allowed & (q_pos[:, :, None] >= k_pos[:, None, :])
        buckets.append(Bucket(rows, head[:, None] * nb + col_block, head, row_block, col_block, allowed.contiguous()))
        order.append(rows)
    inverse = torch.empty(groups * nb, dtype=torch.long, device=keep.device)
    inverse[torch.cat(order)] = torch.arange(groups * nb, device=keep.device)
    return BlockPlan(groups, nb, block, tuple(buckets), inverse)


def _gathered_mask(mask: torch.Tensor, plan: BlockPlan, bucket: Bucket, heads: int) -> torch.Tensor:
    """A caller mask broadcasting against [B, H, S, S], cut to the bucket's blocks in the scores' layout
    [B', H/groups or 1, n, block, width * block] (B' is 1 or B). Only the gathered blocks are copied."""
    nb, block, seq = plan.num_blocks, plan.block, plan.num_blocks * plan.block
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    mask = mask.expand(mask.shape[0], mask.shape[1], seq, seq)  # stride-0 views where the mask broadcasts
    tiles = mask.unflatten(3, (nb, block)).unflatten(2, (nb, block)).permute(0, 1, 2, 4, 3, 5)  # [B',H',nb,nb,blk,blk]
    rows, cols = bucket.row_block[:, None], bucket.col_block
    if plan.groups == 1:
        picked = tiles[:, :, rows, cols]  # [B', H', n, width, blk, blk]
    else:
        head = bucket.head[:, None] if tiles.shape[1] == heads else torch.zeros_like(rows)
        picked = tiles[:, head, rows, cols].unsqueeze(1)  # [B', 1, n, width, blk, blk]
    return picked.permute(0, 1, 2, 4, 3, 5).flatten(-2)


def _bucket_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan, bucket: Bucket,
                      masks: Masks, scale: float, heads: int) -> torch.Tensor:
    """q, k, v: [B, H/groups, groups * nb, block, D]; returns the bucket rows' output [B, H/groups, n, block, D]."""
    n, width = bucket.key_blocks.shape
    lead = q.shape[:2]
    q_rows = q.index_select(2, bucket.rows)
    k_rows = k.index_select(2, bucket.key_blocks.flatten()).reshape(*lead, n, width * plan.block, -1)
    v_rows = v.index_select(2, bucket.key_blocks.flatten()).reshape(*lead, n, width * plan.block, -1)
    scores = ((q_rows * scale) @ k_rows.transpose(-1, -2)).float()  # softmax in fp32 whatever the input dtype
    allowed = bucket.allowed
    if masks.bias is not None:
        scores = scores + _gathered_mask(masks.bias, plan, bucket, heads).float()
    if masks.keep is not None:
        allowed = allowed & _gathered_mask(masks.keep, plan, bucket, heads)
    scores = scores.masked_fill(~allowed, -float("inf"))
    # A row that keeps no key outputs 0, with 0 gradient: see [Note: empty rows] in kernel.py.
    # The check costs a pass over the scores; skipping the product when no row is empty spares autograd a
    # second saved copy of the probabilities.
    has_any = (scores > -float("inf")).any(-1, keepdim=True)
    if bool(has_any.all()):
        probs = torch.softmax(scores, dim=-1)
    else:
        probs = torch.softmax(scores.masked_fill(~has_any, 0.0), dim=-1) * has_any
    return probs.to(v.dtype) @ v_rows


def block_gather_path(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: BlockPlan, masks: Masks,
                      scale: float) -> torch.Tensor:
    """Attention over the plan's blocks only; q, k, v: [B, H, S, D] with S = nb * block."""
    batch, heads, seq, dim = query.shape
    lead = (batch, heads // plan.groups)
    flat = (*lead, plan.groups * plan.num_blocks, plan.block, dim)
    q, k, v = (t.reshape(flat) for t in (query, key, value))
    if not needs_grad(query, key, value, *([masks.bias] if masks.bias is not None else [])):
        outs = [_bucket_attention(q, k, v, plan, bucket, masks, scale, heads) for bucket in plan.buckets]
    else:
        outs = [checkpoint(_bucket_attention, q, k, v, plan, chunk, masks, scale, heads, use_reentrant=False)
                for bucket in plan.buckets
                for chunk in _chunks(bucket, plan.block, lead[0] * lead[1], dim, query.element_size())]
    out = torch.cat(outs, dim=2).index_select(2, plan.inverse)
    return out.reshape(batch, heads, seq, dim)


def _chunks(bucket: Bucket, block: int, batch_heads: int, dim: int, itemsize: int) -> list[Bucket]:
    """The bucket's rows, in order, in pieces of about CHUNK_BYTES of intermediates: per query block row,
    gathered K and V (width·block keys of `dim` values) and fp32 scores and probabilities (block × width·block),
    for each of `batch_heads` batch × head slices."""
    n, width = bucket.key_blocks.shape
    per_row = batch_heads * width * block * (2 * dim * itemsize + 2 * block * 4)
    size = max(1, CHUNK_BYTES // max(per_row, 1))
    if size >= n:
        return [bucket]
    return [replace(bucket, rows=bucket.rows[i:i + size], key_blocks=bucket.key_blocks[i:i + size],
                    head=bucket.head[i:i + size], row_block=bucket.row_block[i:i + size],
                    col_block=bucket.col_block[i:i + size], allowed=bucket.allowed[i:i + size])
            for i in range(0, n, size)]
