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
from ..distributed.collectives import Pending


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


class Reduction:
    """A launched reduction: `done()` says without waiting whether its collective completed; `finish()`
    waits for it and leaves the result in the bucket's `shard_grad`."""

    def __init__(self, pending: Pending, then: Callable[[], None]):
        self._pending, self._then = pending, then

    def done(self) -> bool:
        return self._pending.done()

    def finish(self) -> None:
        self._pending.wait()
        self._then()


class _Done(Reduction):
    """A reduction with nothing to do."""

    def __init__(self) -> None:
        pass

    def done(self) -> bool:
        return True

    def finish(self) -> None:
        pass


DONE = _Done()


class Reducer(Protocol):
    rereduce_safe: bool
    """Reducing a bucket again after more gradients joined it gives the sum of both reductions (see
    grad_buckets.py, [Note: a bucket reduced twice before a step])."""

    def launch(self, bucket: BucketLike) -> Reduction:
        """Start reducing `bucket.flat` (which is scratch until the reduction is finished)."""
        ...

    def global_norm(self, results: list[torch.Tensor]) -> torch.Tensor:
        """The L2 norm over every rank's gradients, given this rank's reduction results (identical on every rank)."""
        ...


def l2_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm over a list of tensors, accumulated in fp32 (a 0-d tensor; 0 for no tensors)."""
    if not tensors:
        return torch.zeros(())
    if len(tensors) == 1:  # the norm of one norm is that norm, exactly (sqrt(x*x) == |x| in IEEE arithmetic)
        return torch.linalg.vector_norm(tensors[0], dtype=torch.float32)
    return torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32) for t in tensors]).norm()


def _on_wire(flat: torch.Tensor, before: float, dtype: torch.dtype) -> torch.Tensor:
    """`flat * before` in the wire dtype, in place when no cast is needed."""
    if dtype == flat.dtype:
        return flat.mul_(before) if before != 1.0 else flat
    return flat.to(dtype).mul_(before) if before != 1.0 else flat.to(dtype)


class AllReduceMean:
    rereduce_safe = True  # the result is the same on every rank: mean(mean + new) = mean + mean(new)

    def __init__(self, comm: Collectives, group: Group, averaging: GradAveraging, reduce_dtype: torch.dtype):
        self.comm, self.group, self.averaging, self.reduce_dtype = comm, group, averaging, reduce_dtype

    def launch(self, bucket: BucketLike) -> Reduction:
        flat = bucket.flat
        wire = _on_wire(flat, self.averaging.before, self.reduce_dtype)
        if self.group.size == 1 and wire is flat and self.averaging.after == 1.0:
            return DONE  # alone, the mean is the bucket itself (a small model's backward paid ~15 us for the call)

        def then() -> None:
            if wire is not flat:
                flat.copy_(wire)
            if self.averaging.after != 1.0:
                flat.mul_(self.averaging.after)

        return Reduction(self.comm.all_reduce(wire, self.group), then)

    def global_norm(self, results: list[torch.Tensor]) -> torch.Tensor:
        return l2_norm(results)  # every rank holds the same reduced gradients


class ReduceScatterMean:
    """Reduce-scatter in place (this rank's chunk of the wire buffer receives the sum), then into the
    owner's slice: `accumulate` (stages 2, 3) adds into a persistent shard; otherwise (stage 1) the
    slice is overwritten with the result."""

    def __init__(self, comm: Collectives, group: Group, averaging: GradAveraging, reduce_dtype: torch.dtype,
                 accumulate: bool):
        self.comm, self.group, self.averaging, self.reduce_dtype = comm, group, averaging, reduce_dtype
        self.accumulate = accumulate
        # Accumulating (stages 2, 3): each reduction adds into the shard. Otherwise (stage 1) it overwrites the
        # shard and leaves the rest of the buffer undefined.
        self.rereduce_safe = accumulate

    def launch(self, bucket: BucketLike) -> Reduction:
        wire, out = self._wire(bucket)
        return Reduction(self.comm.reduce_scatter(out, wire, self.group), self._into_shard(bucket, out))

    def launch_many(self, buckets: list[BucketLike]) -> list[Reduction]:
        """`launch` for each bucket, in order, as coalesced reduce-scatters (on shared memory one stream whose
        pieces the buckets share: `Collectives.reduce_scatter_coalesced`)."""
        wires = [self._wire(bucket) for bucket in buckets]
        pending = self.comm.reduce_scatter_coalesced([out for _, out in wires], [wire for wire, _ in wires], self.group)
        return [Reduction(p, self._into_shard(bucket, out)) for bucket, (_, out), p in zip(buckets, wires, pending)]

    def _wire(self, bucket: BucketLike) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffer that goes on the wire, and this rank's chunk of it (where the sum lands)."""
        wire = _on_wire(bucket.flat, self.averaging.before, self.reduce_dtype)
        return wire, wire.view(self.group.size, -1)[self.group.rank]

    def _into_shard(self, bucket: BucketLike, out: torch.Tensor) -> Callable[[], None]:
        def then() -> None:
            target = bucket.shard_grad
            if self.accumulate:
                target.add_(out, alpha=self.averaging.after)
                return
            if target.data_ptr() != out.data_ptr():  # stage 1 in the wire dtype: `out` already is the slice
                target.copy_(out)
            if self.averaging.after != 1.0:
                target.mul_(self.averaging.after)

        return then

    def global_norm(self, results: list[torch.Tensor]) -> torch.Tensor:
        return partitioned_norm(self.comm, self.group, results)


def partitioned_norm(comm: Collectives, group: Group, results: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm when each rank holds a different part: the squares are summed across the group."""
    if group.size == 1:  # the whole of it is here; sqrt(x*x) == |x|, so skipping the round trip changes no bit
        return l2_norm(results)
    squared = l2_norm(results).pow(2).reshape(1)
    comm.all_reduce(squared, group).wait()
    return squared.sqrt()[0]
