"""Where a tensor-parallel rank's parameter sits in the whole one: a contract between tensor_parallel (which
splits), the engine and checkpoints (which record and reassemble; tensor_parallel/shard.py does the slicing).
See tensor_parallel/shard.py for what `dim`, `blocks` and the parts mean."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorShard:
    dim: int
    rank: int
    size: int
    full_shape: tuple[int, ...]
    blocks: int = 1

    def __post_init__(self) -> None:
        extent = self.full_shape[self.dim]
        if extent % (self.blocks * self.size):
            raise ValueError(f"a dim of {extent} (x{self.blocks} blocks) cannot be split evenly over {self.size} "
                             "tensor-parallel ranks")

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        shape[self.dim] //= self.size
        return tuple(shape)

    def describe(self) -> dict:
        """What the checkpoint manifest records (the rank is the piece's `part`)."""
        return {"dim": self.dim, "parts": self.size, "blocks": self.blocks}

    def with_rank(self, rank: int) -> TensorShard:
        return TensorShard(self.dim, rank, self.size, self.full_shape, self.blocks)
