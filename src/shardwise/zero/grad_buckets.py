"""Gradient buckets: flat buffers that gradients accumulate into, reduced during backward.

Each trainable parameter gets a post-accumulate-grad hook that adds its gradient into its slot of a
bucket and frees the parameter's own `.grad` at once. When a bucket's gradients have all arrived on
a micro-step that reduces, its reduction is launched asynchronously while backward goes on, so
communication overlaps compute. Micro-steps that do not reduce only accumulate (no communication).

Two storage modes:
- persistent (stages 0 and 1): every bucket keeps a full flat buffer for the whole run;
  `shard_grad` is the slice this rank steps on (the whole buffer at stage 0).
- partitioned (stages 2 and 3): a bucket's full buffer exists only from its first gradient until its
  reduce-scatter completes; what persists is `shard_grad`, this rank's slice, accumulated across
  micro-steps. Completed reductions are finished as later gradients arrive, so their buffers go back
  to a `FlatPool` and serve the next buckets: the full buffers live at once are those in flight.

A bucket holds at most `reduce_bucket_size` elements and at most `OVERLAP_BUCKET_BYTES` (see
`bucket_numel`): DeepSpeed's default of 5e8 elements puts any model below 500M parameters in one bucket,
whose reduction can only start when backward has ended.

Buckets are launched strictly in bucket order, so every rank issues the same sequence of
collectives even if hooks fire in a slightly different order (a mismatch would corrupt or hang).

[Note: whose gradient is it] A parameter's hook fires in every backward that reaches the parameter,
whoever started it. Only a gradient that arrives while this engine's own backward window is open
(`begin` ... `finish`, i.e. inside `engine.backward(loss)`) is taken into the buckets. Any other one is
left in `param.grad`, exactly where PyTorch leaves it, and `loose` is set: it may be a direct
`loss.backward()` meant for this engine, or another engine's backward passing through this model (a
GAN's generator loss computed through the discriminator). The two cannot be told apart without
knowing which backward is running (autograd's private graph-task id plus a registry shared by all
engines), and they need not be: leaving the gradient in `param.grad` gives torch's contract. The
script's `model.zero_grad()` clears a gradient it does not want (DeepSpeed's DCGAN tutorial does so for
the discriminator); whatever is still in `param.grad` when this engine next needs gradients (its next
`engine.backward`, or `engine.step`) is adopted (`adopt`): added into the buckets, divided by
gradient_accumulation_steps as DeepSpeed divides a direct backward's gradients, and reduced as
`engine.backward`'s would have been. Its price: such gradients are reduced at `step()`, not during
backward, and at stages 2-3 are held whole until then. With fp16 the engine refuses them (they miss
the loss scale that `engine.backward` applies). This holds at every stage: at stage 3 the gradient
of a released parameter keeps its full shape in `param.grad` (the parameter's data is a placeholder)
and is adopted into its unit's slots like any other.

[Note: gradients accumulate in place] Where a bucket's buffer persists, its reducer may reduce it twice in a
window (`rereduce_safe`) and its parameters are whole and of its dtype (stage 0; stages 1-3 alone, in fp32;
`grads_in_place`), each parameter's `.grad` is its slot (shaped like the parameter) for the window: autograd adds
the gradient into the slot itself, as in torch's own accumulation, and the hook only counts it. Outside the window
`.grad` is None, so [Note: whose gradient is it] holds as before. On a two-engine GAN at world 1 this took a
Python call, a reshape and an add per parameter per backward out of the hook (DDP's gradient_as_bucket_view).
`backward(create_graph=True)` makes autograd replace `.grad` with the sum instead of adding in place: the hook
copies it back into the slot.

[Note: buffers are not zeroed] A partitioned bucket's full buffer comes from the pool holding whatever
its last user left. Each slot's first gradient of the micro-step is written (copied) rather than added,
and at launch (`complete`) the slots no gradient reached and the padding are zeroed. Zeroing every buffer
and adding into it cost 3.7 ms per 25 MiB bucket on CPU, a copy 2.2 ms (the ZeRO-2 step of the 33.7M-parameter
bench GPT at world 2: 2 % faster in an interleaved A/B).

[Note: a bucket reduced twice before a step] Two `engine.backward` calls at an accumulation boundary
(the DCGAN tutorial's discriminator: real, then fake), or gradients adopted at `step()` after an
`engine.backward`, reduce a bucket twice between two optimizer steps. Partitioned buckets add each
reduction into `shard_grad`, and an all-reduce of (mean + new local gradients) is the mean plus the
new mean, so stages 0, 2 and 3 are exact. Stage 1's reduce-scatter overwrites this rank's slice with
the reduction of the whole buffer and leaves the rest of the buffer undefined, so reducing again would
average the first result with leftovers (the reducer says so: `rereduce_safe` is false). Before
anything joins such a bucket again, `reopen` sets its slice aside and zeroes the buffer; the slice is
added back when the next reduction finishes.
"""

from __future__ import annotations

from typing import Callable

import torch

from .flat_param import BucketLayout, plan_buckets
from .reducers import Reducer, Reduction


OVERLAP_BUCKET_BYTES = 25 * 2**20
"""The largest bucket, whatever `reduce_bucket_size` allows: PyTorch DDP's default bucket, which is large
enough for the bus to run at full rate yet lets reductions start early in backward. In an A/B on the
33.7M-parameter bench GPT (CPU, 2 ranks, `benchmarks/zero_stages.py`, 2 rounds x 4 steps, a noisy VM) stages
0/1/2 went from 1.07/1.11/1.10x a one-process compute floor to 1.00/1.05/1.04x, and stage 2's peak RSS fell
by 77 MiB."""


MAX_IN_FLIGHT = 2
"""Reductions under way at once (launch groups of them: [Note: launch groups]); launching another first waits
for the oldest. Without a bound, the full buffers of every bucket whose reduction had not finished stayed live,
as many as backward outran the network: on CPU at stage 3 from a quarter to twice the model's gradients depending
on timing, so no peak could be planned. Two keep one reduction on the wire while the next is queued."""


COALESCE_BUCKET_BYTES = 4 * 2**20
"""Stage 3 on shared memory: a unit's bucket is launched with the next ones until they hold this many bytes of
gradients ([Note: launch groups]), so small units share a collective's pieces and its worker's wake-ups (the 33.7M
bench GPT's 108 unit reduce-scatters per step travel in 27 streams, one per block). The price: at most this many bytes
more of whole gradients waiting beside the ones in flight."""


def bucket_numel(reduce_bucket_size: int, dtype: torch.dtype) -> int:
    """Elements per gradient bucket: `reduce_bucket_size` (DeepSpeed's key, a limit on the elements reduced
    at a time) capped at `OVERLAP_BUCKET_BYTES` of `dtype`, so that reduction overlaps backward."""
    return max(1, min(reduce_bucket_size, OVERLAP_BUCKET_BYTES // dtype.itemsize))


class FlatPool:
    """Full buffers for partitioned buckets, kept from one step to the next on CPU.

    Why: glibc hands a freed buffer this large back to the OS, and the next step pays a page fault per
    4 KiB to get it back (150K faults per step for a 100M-parameter GPT at stage 2 on CPU; the pool and
    the in-place reduce-scatter of `reducers.py` took its step from 7.47 to 7.04 s). Requests
    are met best-fit, and every step makes the same requests in the same order, so after the first step
    nothing is allocated; the pool holds what was in flight at once during backward, which was resident
    then anyway. Other devices have a caching allocator that already does this, so there the pool is a
    pass-through (holding buffers would only keep activations from reusing them).
    """

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []

    def take(self, numel: int, dtype: torch.dtype, device: torch.device, zeroed: bool = True) -> torch.Tensor:
        """A buffer of `numel` elements; with `zeroed=False` its contents are whatever it last held."""
        fits = [i for i, b in enumerate(self._free) if b.numel() >= numel and b.dtype == dtype and b.device == device]
        if not fits:
            return (torch.zeros if zeroed else torch.empty)(numel, dtype=dtype, device=device)
        best = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))[:numel]
        return best.zero_() if zeroed else best

    def give(self, flat: torch.Tensor) -> None:
        if flat.device.type == "cpu":
            self._free.append(flat if flat._base is None else flat._base)


class Bucket:
    def __init__(self, layout: BucketLayout, params: list[torch.nn.Parameter], dtype: torch.dtype,
                 shard: tuple[int, int], partitioned: bool):
        self.layout, self.params, self.dtype = layout, params, dtype
        self.device = params[0].device
        self.shard = shard
        self.partitioned = partitioned
        self.pool = FlatPool()  # GradBuckets gives its buckets one shared pool
        self._filled: list[bool] | None = None
        """Partitioned mode, per slot: whether the slot of `flat` holds this micro-step's gradient yet (see
        [Note: buffers are not zeroed]); None while there is no `flat`, and always in persistent mode."""
        self.flat: torch.Tensor | None = None if partitioned else self.pool.take(layout.padded_numel, dtype, self.device)
        lo, hi = shard
        self.shard_grad = torch.zeros(hi - lo, dtype=dtype, device=self.device) if partitioned else self.flat[lo:hi]
        self.waiting = len(params)
        self.reduced = False
        """The shard holds a finished reduction that a new one would overwrite (see [Note: a bucket reduced
        twice before a step]); only set when the reducer is not `rereduce_safe`."""
        self._set_aside: torch.Tensor | None = None
        # Persistent buffers never change: their slot views are made once (this runs in every gradient
        # hook). Partitioned buffers come and go, and cached views would keep a freed buffer alive.
        self._views = None if partitioned else [self.flat[s.offset : s.offset + s.numel] for s in layout.slots]

    def grad_slots(self) -> list[torch.Tensor] | None:
        """Each parameter's slot shaped like it, to be its `.grad` ([Note: gradients accumulate in place]); None
        when the buffer does not persist or a parameter is not whole or not of the bucket's dtype and device."""
        if self._views is None or any(p.dtype != self.dtype or p.device != self.device or p.numel() != v.numel()
                                      for p, v in zip(self.params, self._views)):
            return None
        return [v.view(p.shape) for v, p in zip(self._views, self.params)]

    def _take_flat(self) -> None:
        """Partitioned mode: a full buffer from the pool, not zeroed (its slots are filled as gradients come)."""
        self.flat = self.pool.take(self.layout.padded_numel, self.dtype, self.device, zeroed=False)
        self._filled = [False] * len(self.params)

    def release(self) -> None:
        """Partitioned mode, once the reduction is finished: the full buffer goes back to the pool."""
        if self.partitioned and self.flat is not None:
            self.pool.give(self.flat)
            self.flat, self._filled = None, None

    def slot_view(self, i: int) -> torch.Tensor:
        """Parameter i's slot of the full buffer (taking the buffer in partitioned mode)."""
        if self._views is not None:
            return self._views[i]
        if self.flat is None:
            self._take_flat()
        slot = self.layout.slots[i]
        return self.flat[slot.offset : slot.offset + slot.numel]

    def accumulate(self, i: int, grad: torch.Tensor, scale: float = 1.0) -> None:
        """Add parameter i's gradient (times `scale`) into its slot."""
        if self.reduced:
            self.reopen()
        slot, grad = (self._views[i] if self._views is not None else self.slot_view(i)), grad.reshape(-1)
        if self._filled is not None and not self._filled[i]:
            # The slot holds another step's leftovers: write, as an add into zeros would (the same values).
            if scale == 1.0:
                slot.copy_(grad)
            else:
                torch.mul(grad, scale, out=slot)
            self._filled[i] = True
        elif scale == 1.0:
            slot.add_(grad)
        else:
            slot.add_(grad, alpha=scale)

    def complete(self) -> None:
        """Before the buffer is reduced: slots no gradient reached this micro-step, and the padding, are zeros.
        Takes the buffer if no gradient came at all."""
        if not self.partitioned:
            return
        if self.flat is None:
            self._take_flat()
        for i, filled in enumerate(self._filled):
            if not filled:
                self.slot_view(i).zero_()
        self.flat[self.layout.numel :].zero_()  # the slots lie end to end from 0 (plan_buckets): then the padding
        self._filled = [True] * len(self.params)

    def reopen(self) -> None:
        """Before a reduced bucket is reduced again: keep its result aside and start from zeros."""
        self._set_aside = self.shard_grad.clone()
        self.flat.zero_()
        if self._filled is not None:
            self._filled = [True] * len(self.params)  # zeros are this micro-step's gradient so far
        self.reduced = False

    def reduction_finished(self, overwrites: bool) -> None:
        if self._set_aside is not None:
            self.shard_grad.add_(self._set_aside)
            self._set_aside = None
        self.reduced = overwrites
        self.release()

    def zero(self) -> None:
        (self.shard_grad if self.partitioned else self.flat).zero_()
        self.reduced, self._set_aside = False, None


class GradBuckets:
    def __init__(self, buckets: list[Bucket], reducer: Reducer, overlap: bool = True,
                 on_complete: Callable[[int], None] | None = None,
                 counts_in_norm: Callable[[torch.nn.Parameter], bool] | None = None, coalesce_numel: int = 0,
                 grads_in_place: bool = True):
        self.buckets = buckets
        self._group_end = plan_launch_groups([b.layout.padded_numel for b in buckets], coalesce_numel)
        """Per bucket, one past the last bucket launched with it ([Note: launch groups])."""
        self._norm_ranges = None if counts_in_norm is None else [_counted_ranges(b, counts_in_norm) for b in buckets]
        """Per bucket, the [start, end) ranges of its shard that count in this rank's norm (None: all of it)."""
        self.reducer = reducer
        self.overlap = overlap
        self.on_complete = on_complete
        """Called with a bucket's index once all its gradients arrived (stage 3 frees the parameters then)."""
        self._hooks = []
        pool = FlatPool()
        for index, bucket in enumerate(buckets):
            bucket.pool = pool
            for i, param in enumerate(bucket.params):
                self._hooks.append(param.register_post_accumulate_grad_hook(self._hook(index, i)))
        self._open = False
        """Inside this engine's backward window: hooks take gradients (see [Note: whose gradient is it])."""
        self.loose = False
        """A gradient arrived outside the window since the last `adopt`: `param.grad` may hold some."""
        self._reducing = False
        self._in_place = grads_in_place and reducer.rereduce_safe
        self._slots: list[list[torch.Tensor] | None] = [None] * len(buckets)
        """Per bucket, its parameters' `.grad` slots ([Note: gradients accumulate in place]) or None; made at the
        first `begin` (ZeRO-3's parameters are whole only from then)."""
        self._pairs: list[tuple[torch.nn.Parameter, torch.Tensor]] | None = None
        self._bound = False
        """In the open window, every parameter of `_pairs` has its slot as `.grad`."""
        self._next = 0
        """The first bucket whose gradients have not all arrived (buckets complete in order, as far as launching goes)."""
        self._launched = 0
        self._in_flight: list[list[tuple[Bucket, Reduction]]] = []
        """Launch groups under way, oldest first, each with the reductions of its buckets not yet finished."""

    @classmethod
    def replicated(cls, params: list[torch.nn.Parameter], reduce_bucket_size: int, dtype: torch.dtype,
                   reducer: Reducer, overlap: bool = True,
                   counts_in_norm: Callable[[torch.nn.Parameter], bool] | None = None) -> GradBuckets:
        """Stage 0: every rank keeps and steps on whole buckets."""
        return cls(plan_grad_buckets(params, reduce_bucket_size, dtype, partitioned=False), reducer, overlap,
                   counts_in_norm=counts_in_norm)

    def begin(self, reduce: bool) -> None:
        """Called before each backward: `reduce` is true on micro-steps whose gradients are reduced."""
        self._open = True
        self._reducing = reduce
        self._next = self._launched = 0
        self._in_flight.clear()
        for bucket in self.buckets:
            bucket.waiting = len(bucket.params)
        self._bind()

    def _bind(self) -> None:
        if self._pairs is None:
            if self._in_place:
                self._slots = [bucket.grad_slots() for bucket in self.buckets]
            self._pairs = [(p, slot) for bucket, slots in zip(self.buckets, self._slots) if slots is not None
                           for p, slot in zip(bucket.params, slots)]
        for k, (p, slot) in enumerate(self._pairs):
            grad = p.grad
            if grad is not None and grad is not slot:
                # A gradient from outside a window that nothing adopted: this window's are taken as copies.
                for q, _ in self._pairs[:k]:
                    q.grad = None
                return
            p.grad = slot
        self._bound = bool(self._pairs)

    def _unbind(self) -> None:
        for p, _ in self._pairs:
            p.grad = None
        self._bound = False

    def _hook(self, index: int, i: int) -> Callable[[torch.Tensor], None]:
        def on_grad(param: torch.Tensor) -> None:
            if not self._open:  # not this engine's backward: leave it in param.grad
                self.loose = True
                return
            bucket = self.buckets[index]
            slots = self._slots[index] if self._bound else None
            if slots is None:
                bucket.accumulate(i, param.grad)
                param.grad = None
            elif param.grad is not slots[i]:  # backward(create_graph=True) replaced the slot with the sum
                slots[i].copy_(param.grad.detach())
                param.grad = slots[i]
            if self._reducing:
                bucket.waiting -= 1
                if bucket.waiting == 0:
                    if self.on_complete is not None:
                        self.on_complete(index)
                    if self.overlap:  # only a bucket just completed can let the next in order go
                        self._launch_ready()
                if self.overlap and self._in_flight:
                    self._finish_completed()

        return on_grad

    def _launch_ready(self) -> None:
        """Launch every group whose buckets have all completed (in order: those before `_next`)."""
        while self._next < len(self.buckets) and self.buckets[self._next].waiting == 0:
            self._next += 1
        while self._launched < self._next and self._group_end[self._launched] <= self._next:
            end = self._group_end[self._launched]
            self._launch(self.buckets[self._launched : end])
            self._launched = end

    def _launch(self, buckets: list[Bucket]) -> None:
        for bucket in buckets:
            bucket.complete()
            if bucket.reduced:  # nothing arrived since its last reduction, which must not be averaged again
                bucket.reopen()
        while len(self._in_flight) >= MAX_IN_FLIGHT:
            for _ in range(len(self._in_flight[0])):  # the oldest group, whole
                self._finish_oldest()
        if len(buckets) == 1:
            reductions = [self.reducer.launch(buckets[0])]
        elif hasattr(self.reducer, "launch_many"):
            reductions = self.reducer.launch_many(buckets)
        else:
            reductions = [self.reducer.launch(bucket) for bucket in buckets]
        self._in_flight.append(list(zip(buckets, reductions)))

    def _finish_completed(self) -> None:
        """Finish reductions that have completed, oldest first, without waiting (frees their buffers)."""
        while self._in_flight and self._in_flight[0][0][1].done():
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        group = self._in_flight[0]
        bucket, reduction = group.pop(0)
        if not group:
            self._in_flight.pop(0)
        reduction.finish()
        bucket.reduction_finished(overwrites=not self.reducer.rereduce_safe)

    def finish(self) -> None:
        """After backward: reduce what is left (parameters unused this step count as zero), then wait."""
        self._open = False
        if self._bound:
            self._unbind()
        if not self._reducing:
            return
        self._next = len(self.buckets)  # parameters unused this step: their buckets count as complete
        self._launch_ready()
        while self._in_flight:
            self._finish_oldest()
        self._reducing = False

    def loose_grads(self) -> int:
        """How many parameters hold a gradient in `param.grad` (from backward passes outside the window)."""
        if not self.loose:
            return 0
        count = sum(p.grad is not None for b in self.buckets for p in b.params)
        self.loose = count > 0
        return count

    def adopt(self, scale: float) -> int:
        """Take every gradient left in `param.grad` into the buckets, times `scale`, and free it; returns how
        many there were. Reducing them is the next window's `finish` (see [Note: whose gradient is it])."""
        if not self.loose:
            return 0
        self.loose = False
        count = 0
        for bucket in self.buckets:
            for i, param in enumerate(bucket.params):
                if param.grad is not None:
                    bucket.accumulate(i, param.grad, scale)
                    param.grad = None
                    count += 1
        return count

    def shard_grads(self) -> list[torch.Tensor]:
        return [b.shard_grad for b in self.buckets]

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the reduced gradients (of those that count here), identical on every rank."""
        if self._norm_ranges is None:
            return self.reducer.global_norm(self.shard_grads())
        counted = [b.shard_grad[lo:hi] for b, ranges in zip(self.buckets, self._norm_ranges) for lo, hi in ranges]
        return self.reducer.global_norm(counted)

    def zero(self) -> None:
        for bucket in self.buckets:
            bucket.zero()

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


class BucketedGrads:
    """The gradient half of `ShardingStrategy` for a strategy whose gradients live in `self.buckets`
    (every ZeRO stage): each method is the one home of its logic in `GradBuckets` or the reducer."""

    buckets: GradBuckets

    def finish_backward(self) -> None:
        self.buckets.finish()

    def loose_param_grads(self) -> int:
        return self.buckets.loose_grads()

    def adopt_param_grads(self, scale: float) -> int:
        """At stage 3 a released parameter's gradient keeps its full shape: it goes into the unit's slots
        like any other."""
        return self.buckets.adopt(scale)

    def grad_norm(self) -> torch.Tensor:
        return self.buckets.grad_norm()

    def scale_grads(self, factor: float) -> None:
        torch._foreach_mul_(self.buckets.shard_grads(), factor)

    def zero_grads(self) -> None:
        self.buckets.zero()


def plan_launch_groups(numels: list[int], coalesce_numel: int) -> list[int]:
    """[Note: launch groups] Consecutive buckets are launched together until they hold `coalesce_numel` elements
    (0: each alone), and their reductions travel as one coalesced collective (`Reducer.launch_many`). The
    groups are fixed when the buckets are made, the same on every rank whatever order the gradients arrive
    in, since ranks must stream the same collectives. Per bucket: one past the last bucket of its group."""
    ends, start, total = [0] * len(numels), 0, 0
    for i, numel in enumerate(numels):
        total += numel
        if total >= coalesce_numel or i == len(numels) - 1:
            ends[start : i + 1] = [i + 1] * (i + 1 - start)
            start, total = i + 1, 0
    return ends


def _counted_ranges(bucket: Bucket, counts: Callable[[torch.nn.Parameter], bool]) -> list[tuple[int, int]]:
    """The ranges of `bucket`'s shard that hold gradients of parameters `counts` accepts."""
    lo, hi = bucket.shard
    ranges = []
    for slot, param in zip(bucket.layout.slots, bucket.params):
        start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if start < end and counts(param):
            ranges.append((start - lo, end - lo))
    return ranges


def plan_grad_buckets(params: list[torch.nn.Parameter], reduce_bucket_size: int, dtype: torch.dtype,
                      rank: int = 0, world: int = 1, partitioned: bool = False) -> list[Bucket]:
    """Buckets over `params` of at most `bucket_numel` elements, each padded for `world` ranks, with
    `rank`'s shard of each (the whole bucket when world is 1)."""
    # Gradients arrive roughly in reverse registration order: bucket in that order so the first bucket
    # fills (and is sent) first.
    ordered = list(reversed(params))
    buckets, start = [], 0
    for layout in plan_buckets([p.numel() for p in ordered], bucket_numel(reduce_bucket_size, dtype), world):
        members = ordered[start : start + len(layout.slots)]
        start += len(members)
        buckets.append(Bucket(layout, members, dtype, layout.shard_range(rank, world), partitioned=partitioned))
    return buckets
