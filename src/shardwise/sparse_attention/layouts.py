"""Block-sparsity layouts with DeepSpeed's names and arguments: which key blocks each query block sees.

`make_layout(seq_len)` returns an int64 tensor [num_heads, num_blocks, num_blocks] of 0/1, block (i, j) = 1
when the queries of block i may attend to the keys of block j. Pure: no process group. Random blocks come
from a `torch.Generator` seeded with `seed`, never the global RNG, so every rank builds the same layout
without a broadcast (DeepSpeed broadcasts rank 0's layout instead).

[Note: unidirectional layouts] A unidirectional ("causal") layout is made lower-triangular at block level,
and the attention kernel also masks keys after the query inside the diagonal blocks. Blocks above the
diagonal hold only future keys, so dropping them changes no result; it makes two DeepSpeed corners
agree with that rule: Fixed with num_global_blocks > 1 marks a block right of the diagonal, and Variable
draws its random blocks from the whole row (BigBird draws them from the past only); here both only
ever see the past. Where a row has fewer past blocks than `num_random_blocks`, it takes all of them
(DeepSpeed raises from inside `random.sample` there).
"""

from __future__ import annotations

from typing import Sequence

import torch

ATTENTIONS = ("bidirectional", "unidirectional")


class SparsityConfigError(ValueError):
    """A sparsity configuration argument a layout cannot be built from."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise SparsityConfigError(message)


class SparsityConfig:
    """The base: `num_heads` heads cut into `block` × `block` tiles; one layout for all heads unless
    `different_layout_per_head`. Subclasses fill head `h` in `_fill(layout_h, h, generator)`."""

    attention = "bidirectional"

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False) -> None:
        _require(isinstance(num_heads, int) and num_heads >= 1,
                 f"num_heads: a positive number of attention heads is required; got {num_heads!r}.")
        _require(isinstance(block, int) and block >= 1, f"block: a positive block size is required; got {block!r}.")
        self.num_heads = num_heads
        self.block = block
        self.different_layout_per_head = different_layout_per_head
        self.num_layout_heads = num_heads if different_layout_per_head else 1

    def num_blocks(self, seq_len: int) -> int:
        _require(seq_len % self.block == 0,
                 f"seq_len: must be a multiple of block ({self.block}); got {seq_len}. Pad the sequence to "
                 f"{-(-seq_len // self.block) * self.block} (SparseAttentionUtils.pad_to_block_size).")
        return seq_len // self.block

    def setup_layout(self, seq_len: int) -> torch.Tensor:
        """An all-zero layout [num_heads, num_blocks, num_blocks] for `seq_len` tokens."""
        n = self.num_blocks(seq_len)
        return torch.zeros((self.num_heads, n, n), dtype=torch.int64)

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        generator = torch.Generator().manual_seed(getattr(self, "seed", 0))
        for h in range(self.num_layout_heads):
            self._fill(layout[h], h, generator)
        if not self.different_layout_per_head:
            layout[1:] = layout[0]
        if self.attention == "unidirectional":  # see [Note: unidirectional layouts]
            layout = torch.tril(layout)
        return layout

    def _fill(self, layout: torch.Tensor, h: int, generator: torch.Generator) -> None:
        raise NotImplementedError(f"{type(self).__name__}: a layout class must define _fill; use one of the "
                                  "configs in shardwise.sparse_attention (Dense, Fixed, Variable, BigBird, ...).")

    def _set_attention(self, attention: str) -> None:
        _require(attention in ATTENTIONS, f"attention: one of {list(ATTENTIONS)} is required; got {attention!r}.")
        self.attention = attention


class DenseSparsityConfig(SparsityConfig):
    """Every block: plain attention, kept to compare sparse layouts with. `attention` (a shardwise addition)
    makes it causal, for decoders."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 attention: str = "bidirectional") -> None:
        super().__init__(num_heads, block, different_layout_per_head)
        self._set_attention(attention)

    def _fill(self, layout: torch.Tensor, h: int, generator: torch.Generator) -> None:
        layout.fill_(1)


def _random_blocks(layout: torch.Tensor, count: int, causal: bool, generator: torch.Generator) -> None:
    """`count` distinct random key blocks in each row (from the past and the diagonal only if `causal`)."""
    n = layout.shape[0]
    _require(count <= n, f"num_random_blocks: at most the number of blocks in a row ({n}) is required; got {count}. "
             "Lower it or use a longer sequence.")
    for row in range(n):
        available = row + 1 if causal else n
        picked = torch.randperm(available, generator=generator)[:min(count, available)]
        layout[row, picked] = 1


def _windows(layout: torch.Tensor, sizes: Sequence[int]) -> None:
    """Local windows along the diagonal: `sizes` in order, the last size repeated to the end."""
    n, start, i = layout.shape[0], 0, 0
    while start < n:
        size = sizes[min(i, len(sizes) - 1)]
        end = min(start + size, n)
        layout[start:end, start:end] = 1
        start, i = end, i + 1


def _sliding(layout: torch.Tensor, width: int, name: str = "num_sliding_window_blocks") -> None:
    n = layout.shape[0]
    _require(width <= n, f"{name}: at most the number of blocks in a row ({n}) is required; got {width}. "
             "Lower it or use a longer sequence.")
    half = width // 2
    for row in range(n):
        layout[row, max(0, row - half):min(row + half + 1, n)] = 1


def _check_ranges(starts: Sequence[int], ends: Sequence[int] | None) -> None:
    if ends is None:
        return
    _require(len(starts) == len(ends), f"global_block_end_indices: one end per start in global_block_indices "
             f"({len(starts)}) is required; got {len(ends)}. Give both lists the same length.")
    for start, end in zip(starts, ends):
        _require(start < end, f"global_block_end_indices: each end must exceed its start; got start {start}, end "
                 f"{end}. Ends are exclusive.")


def _global_ranges(layout: torch.Tensor, starts: Sequence[int], ends: Sequence[int] | None,
                   rows: bool, causal: bool) -> None:
    """Global key blocks (columns) every query attends to and, if `rows`, global queries that see all."""
    n = layout.shape[0]
    for i, start in enumerate(starts):
        if start >= n:
            continue  # a global block past this sequence's end: none here
        end = min(ends[i], n) if ends is not None else start + 1
        if rows:
            layout[start:end, :] = 1
        layout[start if causal else 0:, start:end] = 1


class FixedSparsityConfig(SparsityConfig):
    """`Fixed` (Sparse Transformers): local windows of `num_local_blocks`; in each window, the last
    `num_global_blocks` (counted back by pattern h % num_different_global_patterns) are global columns."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_local_blocks: int = 4, num_global_blocks: int = 1, attention: str = "bidirectional",
                 horizontal_global_attention: bool = False, num_different_global_patterns: int = 1) -> None:
        super().__init__(num_heads, block, different_layout_per_head)
        _require(num_local_blocks >= 1 and num_global_blocks >= 1 and num_local_blocks % num_global_blocks == 0,
                 f"num_local_blocks: a positive multiple of num_global_blocks ({num_global_blocks}) is required; got "
                 f"{num_local_blocks}.")
        self._set_attention(attention)
        _require(not (horizontal_global_attention and attention == "unidirectional"),
                 "horizontal_global_attention: needs attention \"bidirectional\"; got true with \"unidirectional\" "
                 "(global rows would see future tokens). Set it false.")
        _require(num_different_global_patterns == 1 or different_layout_per_head,
                 f"num_different_global_patterns: more than 1 needs different_layout_per_head true; got "
                 f"{num_different_global_patterns} with a single layout. Set different_layout_per_head or use 1.")
        patterns = num_local_blocks // num_global_blocks
        _require(1 <= num_different_global_patterns <= patterns,
                 f"num_different_global_patterns: at most num_local_blocks / num_global_blocks = {num_local_blocks} / "
                 f"{num_global_blocks} = {patterns} is required; got {num_different_global_patterns}.")
        self.num_local_blocks = num_local_blocks
        self.num_global_blocks = num_global_blocks
        self.horizontal_global_attention = horizontal_global_attention
        self.num_different_global_patterns = num_different_global_patterns

    def _fill(self, layout: torch.Tensor, h: int, generator: torch.Generator) -> None:
        n, local, width = layout.shape[0], self.num_local_blocks, self.num_global_blocks
        _windows(layout, [local])
        first = local - (1 + h % self.num_different_global_patterns) * width  # offset of the global blocks
        whole = n - n % local  # blocks covered by complete windows
        starts = list(range(first, whole, local))
        if whole < n:  # a short last window: its global blocks as far right as fit
            starts.append(min(whole + first, n - width))
        causal = self.attention == "unidirectional"
        for start in starts:
            if self.horizontal_global_attention:
                layout[start:start + width, :] = 1
            layout[start if causal else 0:, start:start + width] = 1


class VariableSparsityConfig(SparsityConfig):
    """`Variable`: local windows of the sizes listed (the last repeated), global blocks by index or by
    [start, end) ranges, and `num_random_blocks` random blocks per row."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_random_blocks: int = 0, local_window_blocks: Sequence[int] = (4,),
                 global_block_indices: Sequence[int] = (0,), global_block_end_indices: Sequence[int] | None = None,
                 attention: str = "bidirectional", horizontal_global_attention: bool = False, seed: int = 0) -> None:
        super().__init__(num_heads, block, different_layout_per_head)
        _require(num_random_blocks >= 0, f"num_random_blocks: 0 or more is required; got {num_random_blocks}.")
        _require(len(local_window_blocks) > 0 and all(w >= 1 for w in local_window_blocks),
                 f"local_window_blocks: a non-empty list of positive sizes is required; got {list(local_window_blocks)}.")
        _check_ranges(global_block_indices, global_block_end_indices)
        self._set_attention(attention)
        _require(not (horizontal_global_attention and attention == "unidirectional"),
                 "horizontal_global_attention: needs attention \"bidirectional\"; got true with \"unidirectional\" "
                 "(global rows would see future tokens). Set it false.")
        self.num_random_blocks = num_random_blocks
        self.local_window_blocks = list(local_window_blocks)
        self.global_block_indices = list(global_block_indices)
        self.global_block_end_indices = None if global_block_end_indices is None else list(global_block_end_indices)
        self.horizontal_global_attention = horizontal_global_attention
        self.seed = seed

    def _fill(self, layout: torch.Tensor, h: int, generator: torch.Generator) -> None:
        causal = self.attention == "unidirectional"
        if self.num_random_blocks:
            _random_blocks(layout, self.num_random_blocks, causal, generator)
        _windows(layout, self.local_window_blocks)
        _global_ranges(layout, self.global_block_indices, self.global_block_end_indices,
                       self.horizontal_global_attention, causal)


class BigBirdSparsityConfig(SparsityConfig):
    """`BigBird`: random blocks, a sliding window of `num_sliding_window_blocks` centred on the diagonal,
    and the first `num_global_blocks` blocks global both ways."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_random_blocks: int = 1, num_sliding_window_blocks: int = 3, num_global_blocks: int = 1,
                 attention: str = "bidirectional", seed: int = 0) -> None:
        super().__init__(num_heads, block, different_layout_per_head)
        for name, value in (("num_random_blocks", num_random_blocks), ("num_global_blocks", num_global_blocks)):
            _require(value >= 0, f"{name}: 0 or more is required; got {value}.")
        _require(num_sliding_window_blocks >= 1,
                 f"num_sliding_window_blocks: 1 or more is required; got {num_sliding_window_blocks}.")
        self._set_attention(attention)
        self.num_random_blocks = num_random_blocks
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.num_global_blocks = num_global_blocks
        self.seed = seed

    def _fill(self, layout: torch.Tensor, h: int, generator: torch.Generator) -> None:
        n = layout.shape[0]
        _random_blocks(layout, self.num_random_blocks, self.attention == "unidirectional", generator)
        _sliding(layout, self.num_sliding_window_blocks)
        _require(self.num_global_blocks <= n, f"num_global_blocks: at most the number of blocks in a row ({n}) is "
                 f"required; got {self.num_global_blocks}. Lower it or use a longer sequence.")
        layout[:self.num_global_blocks, :] = 1
        layout[:, :self.num_global_blocks] = 1


class BSLongformerSparsityConfig(SparsityConfig):
    """Block-sparse `Longformer`: a sliding window plus global blocks (by index or range) both ways."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_sliding_window_blocks: int = 3, global_block_indices: Sequence[int] = (0,),
                 global_block_end_indices: Sequence[int] | None = None, attention: str = "bidirectional") -> None:
        super().__init__(num_heads, block, different_layout_per_head)
        _require(num_sliding_window_blocks >= 1,
                 f"num_sliding_window_blocks: 1 or more is required; got {num_sliding_window_blocks}.")
        _check_ranges(global_block_indices, global_block_end_indices)
        self._set_attention(attention)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.global_block_indices = list(global_block_indices)
        self.global_block_end_indices = None if global_block_end_indices is None else list(global_block_end_indices)

    def _fill(self, layout: torch.Tensor, h: int, generator: torch.Generator) -> None:
        _sliding(layout, self.num_sliding_window_blocks)
        _global_ranges(layout, self.global_block_indices, self.global_block_end_indices, rows=True, causal=False)


class LocalSlidingWindowSparsityConfig(SparsityConfig):
    """Only a sliding window: `num_sliding_window_blocks` centred on the diagonal, or the diagonal and the
    blocks before it when unidirectional (DeepSpeed's default here)."""

    def __init__(self, num_heads: int, block: int = 16, num_sliding_window_blocks: int = 3,
                 attention: str = "unidirectional") -> None:
        super().__init__(num_heads, block)
        _require(num_sliding_window_blocks >= 1,
                 f"num_sliding_window_blocks: 1 or more is required; got {num_sliding_window_blocks}.")
        self._set_attention(attention)
        self.num_sliding_window_blocks = num_sliding_window_blocks

    def _fill(self, layout: torch.Tensor, h: int, generator: torch.Generator) -> None:
        _sliding(layout, self.num_sliding_window_blocks)  # the upper half goes with [Note: unidirectional layouts]
