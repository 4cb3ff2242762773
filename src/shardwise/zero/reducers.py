"""How a bucket's flat gradient becomes the averaged gradient this rank steps on.

Stage 0 all-reduces the whole bucket. Stages 1 and 2 reduce-scatter it, so each rank receives only
the slice it owns: the same bytes on the wire as an all-reduce's reduce-scatter half, and the
all-gather half is paid later with updated parameters instead of gradients (ZeRO adds no traffic).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from ..distributed import Collectives, Group


@dataclass(frozen=True)
class GradAveraging:
    """How the sum over ranks becomes a mean: scale before and after the reduction.

    DeepSpeed's semantics: `prescale_gradients` divides by the world size before reducing; otherwise
    gradients are divided by `gradient_predivide_factor` before and multiplied by factor / world after
    (which keeps fp16 sums in range for large worlds).
    """

    before: float
    after: float

    @classmethod
    def make(cls, world: int, prescale: bool, predivide_factor: float) -> GradAveraging:
        if prescale:
            return cls(1.0 / world, 1.0)
        return cls(1.0 / predivide_factor, predivide_factor / world)


class BucketLike(Protocol):
    flat: torch.Tensor | None
    shard_grad: torch.Tensor


class Reducer(Protocol):
    def launch(self, bucket: BucketLike) -> Callable[[], None]:
        """Start reducing `bucket.flat`; the returned callable waits and leaves the result in `bucket.shard_grad`."""
        ...


def _on_wire(flat: torch.Tensor, before: float, dtype: torch.dtype) -> torch.Tensor:
    """`flat * before` in the wire dtype, in place when no cast is needed."""
    if dtype == flat.dtype:
        return flat.mul_(before) if before != 1.0 else flat
    return flat.to(dtype).mul_(before) if before != 1.0 else flat.to(dtype)


class AllReduceMean:
    def __init__(self, comm: Collectives, group: Group, averaging: GradAveraging, reduce_dtype: torch.dtype):
        self.comm, self.group, self.averaging, self.reduce_dtype = comm, group, averaging, reduce_dtype

    def launch(self, bucket: BucketLike) -> Callable[[], None]:
        flat = bucket.flat
        wire = _on_wire(flat, self.averaging.before, self.reduce_dtype)
        pending = self.comm.all_reduce(wire, self.group)

        def finish() -> None:
            pending.wait()
            if wire is not flat:
                flat.copy_(wire)
            if self.averaging.after != 1.0:
                flat.mul_(self.averaging.after)

        return finish


class ReduceScatterMean:
    """Reduce-scatter into the owner's slice. `accumulate` (stage 2) adds into a persistent shard and
    frees the bucket's full buffer; otherwise (stage 1) the slice is overwritten with the result."""

    def __init__(self, comm: Collectives, group: Group, averaging: GradAveraging, reduce_dtype: torch.dtype,
                 accumulate: bool):
        self.comm, self.group, self.averaging, self.reduce_dtype = comm, group, averaging, reduce_dtype
        self.accumulate = accumulate

    def launch(self, bucket: BucketLike) -> Callable[[], None]:
        wire = _on_wire(bucket.flat, self.averaging.before, self.reduce_dtype)
        out = torch.empty(wire.numel() // self.group.size, dtype=wire.dtype, device=wire.device)
        pending = self.comm.reduce_scatter(out, wire, self.group)

        def finish() -> None:
            pending.wait()
            target = bucket.shard_grad
            if self.accumulate:
                target.add_(out, alpha=self.averaging.after)
                bucket.flat = None  # the full gradient is no longer needed: free it now
            else:
                target.copy_(out)
                if self.averaging.after != 1.0:
                    target.mul_(self.averaging.after)

        return finish
