"""Where a tensor-parallel rank's parameter sits in the whole one: pure slicing and assembly, no processes.

A parameter split over `size` tensor-parallel ranks along `dim` holds, on rank `rank`, the `rank`-th of `size`
equal pieces of that dim. A fused projection (GPT-2's `c_attn`: q, k and v side by side) is split block by
block: the dim is `blocks` equal blocks and each rank holds its piece of every block, so q, k and v stay whole
heads on every rank. The checkpoint package reads and writes shards through these functions, which is how a
checkpoint taken at one tensor-parallel size loads at any other.
"""

from __future__ import annotations

import torch

from ..protocols.tensor_shard import TensorShard

__all__ = ["TensorShard", "assemble", "local_index", "take"]


def take(full: torch.Tensor, shard: TensorShard) -> torch.Tensor:
    """This rank's piece of `full` (a view where possible)."""
    blocks = full.unflatten(shard.dim, (shard.blocks, -1))
    return blocks.chunk(shard.size, dim=shard.dim + 1)[shard.rank].flatten(shard.dim, shard.dim + 1)


def local_index(ids: torch.Tensor, start: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices into a rank's slice [start, start + width) of a vocabulary-split tensor: `ids - start` (0 where
    outside the slice), and the mask of the ids outside it (another rank's)."""
    outside = (ids < start) | (ids >= start + width)
    return (ids - start).masked_fill(outside, 0), outside


def assemble(parts: list[torch.Tensor], dim: int, blocks: int = 1) -> torch.Tensor:
    """The whole tensor from every rank's piece, in rank order (the inverse of `take`)."""
    split = [p.unflatten(dim, (blocks, -1)) for p in parts]
    return torch.cat(split, dim=dim + 1).flatten(dim, dim + 1)
