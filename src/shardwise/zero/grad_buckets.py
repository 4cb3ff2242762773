"""Gradient buckets: flat fp32 buffers that gradients accumulate into, reduced during backward.

Each trainable parameter gets a post-accumulate-grad hook that adds its gradient into its slot of a
bucket and frees the parameter's own `.grad` at once. On a micro-step that ends an accumulation
window, a bucket whose gradients have all arrived is reduced asynchronously while backward goes on,
so communication overlaps compute; other micro-steps only accumulate (no communication).

Buckets are launched strictly in bucket order, so every rank issues the same sequence of
collectives even if hooks fire in a slightly different order (a mismatch would corrupt or hang).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from ..distributed import Collectives, Group
from ..distributed.collectives import Pending
from .flat_param import BucketLayout, plan_buckets


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


class Reducer(Protocol):
    """Reduces one bucket's flat gradient; stage 0 all-reduces, stage 2 reduce-scatters."""

    def launch(self, flat: torch.Tensor) -> Callable[[], None]:
        """Start the reduction of `flat`; the returned callable waits and finishes it."""
        ...


class AllReduceMean:
    def __init__(self, comm: Collectives, group: Group, averaging: GradAveraging, reduce_dtype: torch.dtype):
        self.comm, self.group, self.averaging, self.reduce_dtype = comm, group, averaging, reduce_dtype

    def launch(self, flat: torch.Tensor) -> Callable[[], None]:
        before, after = self.averaging.before, self.averaging.after
        wire = flat if self.reduce_dtype == flat.dtype else torch.empty_like(flat, dtype=self.reduce_dtype)
        if wire is flat:
            if before != 1.0:
                flat.mul_(before)
        else:
            torch.mul(flat, before, out=wire) if before != 1.0 else wire.copy_(flat)
        pending: Pending = self.comm.all_reduce(wire, self.group)

        def finish() -> None:
            pending.wait()
            if wire is not flat:
                flat.copy_(wire)
            if after != 1.0:
                flat.mul_(after)

        return finish


class _Bucket:
    def __init__(self, layout: BucketLayout, params: list[torch.nn.Parameter], dtype: torch.dtype):
        device = params[0].device
        self.layout = layout
        self.flat = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
        self.views = [self.flat[s.offset : s.offset + s.numel].view_as(p) for s, p in zip(layout.slots, params)]
        self.waiting = len(params)


class GradBuckets:
    def __init__(self, params: list[torch.nn.Parameter], bucket_numel: int, dtype: torch.dtype, reducer: Reducer):
        # Gradients arrive roughly in reverse registration order: bucket in that order so the first
        # bucket fills (and is sent) first.
        ordered = list(reversed(params))
        layouts = plan_buckets([p.numel() for p in ordered], bucket_numel)
        self.reducer = reducer
        self.buckets: list[_Bucket] = []
        self._views: dict[int, torch.Tensor] = {}
        self._hooks = []
        start = 0
        for layout in layouts:
            members = ordered[start : start + len(layout.slots)]
            start += len(layout.slots)
            bucket = _Bucket(layout, members, dtype)
            index = len(self.buckets)
            self.buckets.append(bucket)
            for param, view in zip(members, bucket.views):
                self._views[id(param)] = view
                self._hooks.append(param.register_post_accumulate_grad_hook(self._hook(index, view)))
        self.params = params
        self._reducing = False
        self._next = 0
        self._in_flight: list[Callable[[], None]] = []

    def view(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The accumulated (and, after `finish`, reduced) gradient of `param`."""
        return self._views[id(param)]

    def begin(self, reduce: bool) -> None:
        """Called before each backward: `reduce` is true on the micro-step that ends accumulation."""
        self._reducing = reduce
        self._next = 0
        self._in_flight.clear()
        for bucket in self.buckets:
            bucket.waiting = len(bucket.views)

    def _hook(self, index: int, view: torch.Tensor) -> Callable[[torch.Tensor], None]:
        def on_grad(param: torch.Tensor) -> None:
            view.add_(param.grad.view_as(view))
            param.grad = None
            if self._reducing:
                bucket = self.buckets[index]
                bucket.waiting -= 1
                self._launch_ready()

        return on_grad

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].waiting == 0:
            self._in_flight.append(self.reducer.launch(self.buckets[self._next].flat))
            self._next += 1

    def finish(self) -> None:
        """After backward: reduce what is left (parameters unused this step count as zero), then wait."""
        if not self._reducing:
            return
        for bucket in self.buckets[self._next :]:
            self._in_flight.append(self.reducer.launch(bucket.flat))
        self._next = len(self.buckets)
        for finish in self._in_flight:
            finish()
        self._in_flight.clear()
        self._reducing = False

    def flats(self) -> list[torch.Tensor]:
        return [b.flat for b in self.buckets]

    def zero(self) -> None:
        for bucket in self.buckets:
            bucket.flat.zero_()

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
