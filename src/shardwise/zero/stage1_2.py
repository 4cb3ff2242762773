"""ZeRO stages 1 and 2: optimizer state (1) and gradients (2) partitioned across data-parallel ranks.

The trainable parameters of each optimizer group are laid out in flat buckets (`flat_param.py`),
padded so every rank owns an equal contiguous slice of each bucket. The module's parameters become
views into these flat buffers, so the module itself is unchanged for forward, evaluation and
`state_dict()`. Each rank keeps fp32 master weights (with `bf16_master_weights_and_grads`, the bf16
parameters' own slices) and optimizer state only for its slices, steps
them, and all-gathers the updated slices back into the flat buffers.

Stage 1 keeps full gradient buckets (reduced once per accumulation window by reduce-scatter into the
owner's slice); stage 2 keeps only the owned slice of each gradient and reduce-scatters every
micro-step during backward (see `grad_buckets.py`, partitioned mode).

Options DeepSpeed has that are no-ops here, and why: `contiguous_gradients` (gradients always go
into contiguous buckets), `reduce_scatter` (always on: half the bytes of an all-reduce),
`allgather_partitions` (always one all-gather per bucket), `allgather_bucket_size` (the all-gather
runs per reduce bucket, so `reduce_bucket_size`, capped at 25 MiB for overlap, bounds both), `round_robin_gradients` (an ordering
aid for CPU offload), `elastic_checkpoint` (checkpoints are saved by parameter name).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..offload import make_optimizer_offload
from ..protocols import ModelStateTensors, NoRankLocalState, StateSlot, StrategyInputs
from .edits import register_replicated, take_edits
from .flat_param import BucketLayout
from .grad_buckets import Bucket, BucketedGrads, GradBuckets, plan_grad_buckets
from .reducers import AllReduceMean, GradAveraging, ReduceScatterMean
from .stage0 import trainable_parameters, whole_state_dict


class ShardedDataParallel(NoRankLocalState, BucketedGrads):
    def __init__(self, inputs: StrategyInputs, stage: int):
        self.module, self.precision, self.group, self.comm = inputs.module, inputs.precision, inputs.dp_group, inputs.comm
        self.stage = stage
        self.reduces_every_micro_step = stage == 2
        groups = _trainable_groups(inputs.param_groups, trainable_parameters(self.module))
        # [Note: a data-parallel group of one] Alone, a rank's slice is the whole bucket and reducing is the identity:
        # stage 2's buckets stay whole (its gradients accumulate straight into them, not into a scratch buffer that
        # is then added into the slice) and the reduction is stage 0's, which may run twice in a window at no cost.
        alone = self.group.size == 1
        buckets: list[Bucket] = []
        self.bucket_group: list[int] = []
        for index, params in enumerate(groups):
            planned = plan_grad_buckets(params, inputs.zero.reduce_bucket_size, self.precision.grad_accum_dtype,
                                        self.group.rank, self.group.size, partitioned=stage == 2 and not alone)
            buckets += planned
            self.bucket_group += [index] * len(planned)
        self.offload = make_optimizer_offload(inputs.zero.offload_optimizer, inputs.zero.sub_group_size,
                                              self.group.rank, inputs.aio)
        self.param_flats, self.masters = zip(*(self._flatten(b) for b in buckets)) if buckets else ((), ())
        self._aliased = [m.data_ptr() == f[b.shard[0]:].data_ptr() for m, f, b in zip(self.masters, self.param_flats, buckets)]
        if self.precision.casts_module:
            self.module.to(dtype=self.precision.param_dtype)  # frozen parameters and buffers
        averaging = GradAveraging.make(self.group.size, inputs.prescale_gradients, inputs.gradient_predivide_factor)
        reducer = (AllReduceMean(self.comm, self.group, averaging, self.precision.reduce_dtype) if alone else
                   ReduceScatterMean(self.comm, self.group, averaging, self.precision.reduce_dtype, accumulate=stage == 2))
        self.buckets = GradBuckets(buckets, reducer, overlap=inputs.zero.overlap_comm, counts_in_norm=inputs.counts_in_norm)
        self.optimizer = inputs.make_optimizer(self._master_groups(inputs.param_groups))
        self.offload.bind(self.optimizer)
        register_replicated(self.module.parameters(), self)

    def _flatten(self, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        """Move the bucket's parameters into one flat buffer; return it and this rank's master slice."""
        layout: BucketLayout = bucket.layout
        full = torch.zeros(layout.padded_numel, dtype=self.precision.master_dtype, device=bucket.device)
        for slot, p in zip(layout.slots, bucket.params):
            full[slot.offset : slot.offset + slot.numel].copy_(p.detach().reshape(-1))
        lo, hi = bucket.shard
        if self.precision.mixed:
            # The master slice comes from the fp32 weights, before they are rounded to 16 bits.
            master = self.offload.home(full[lo:hi].clone())
            full = full.to(self.precision.param_dtype)
        else:
            # fp32 (or bf16 with bf16_master_weights_and_grads) on the device: the owned slice is the master.
            master = self.offload.home(full[lo:hi])
        for slot, p in zip(layout.slots, bucket.params):
            p.data = full[slot.offset : slot.offset + slot.numel].view_as(p)
        return full, master

    def _master_groups(self, param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        mapped = [{**g, "params": []} for g in param_groups]
        for master, index in zip(self.masters, self.bucket_group):
            mapped[index]["params"].append(master)
        return mapped

    def begin_backward(self, reduce: bool) -> None:
        self.buckets.begin(reduce or self.reduces_every_micro_step)

    def optimizer_step(self) -> None:
        self.offload.step(self.optimizer, list(self.masters), self.buckets.shard_grads(), self._write_back)

    def sync_params(self) -> None:
        self._all_gather_params()

    def _write_back(self, i: int) -> None:
        """Master slice i into this rank's slice of the 16-bit (or offloaded fp32) flat parameters."""
        if not self._aliased[i]:
            lo, hi = self.buckets.buckets[i].shard
            with torch.no_grad():
                self.param_flats[i][lo:hi].copy_(self.masters[i], non_blocking=True)

    def _all_gather_params(self) -> None:
        if self.group.size == 1:
            return  # each flat buffer is its own slice: nothing to gather
        pending = []
        for flat, bucket in zip(self.param_flats, self.buckets.buckets):
            lo, hi = bucket.shard
            pending.append(self.comm.all_gather(flat, flat[lo:hi], self.group))
        for p in pending:
            p.wait()

    def keep_edits(self, params: list[torch.nn.Parameter], src: int) -> None:
        """Rank `src`'s values of `params` everywhere and in this rank's master slices ([Note: edits reach the
        masters])."""
        for p in params:
            self.comm.broadcast(p.data, src, self.group).wait()
        edited = {id(p) for p in params}
        with self.offload.resident():
            for i, bucket in enumerate(self.buckets.buckets):
                if not self._aliased[i] and any(id(p) in edited for p in bucket.params):
                    lo, hi = bucket.shard
                    take_edits(self.masters[i], self.param_flats[i][lo:hi])

    def explain_forward_error(self, error: BaseException) -> str | None:
        return None  # the module's parameters are whole views into the flat buffers: nothing of ours can be the cause

    def consolidated_state_dict(self, exclude_frozen: bool = False) -> dict[str, torch.Tensor] | None:
        return whole_state_dict(self.module, exclude_frozen)  # the flat buffers are whole after sync_params

    def load_module_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        self.module.load_state_dict(state, strict=strict)  # parameters are views: this fills the flat buffers
        with self.offload.resident(), torch.no_grad():
            for master, flat, bucket, aliased in zip(self.masters, self.param_flats, self.buckets.buckets, self._aliased):
                if not aliased:
                    lo, hi = bucket.shard
                    master.copy_(flat[lo:hi])

    def state_slots(self) -> list[StateSlot]:
        names = {id(p): n for n, p in self.module.named_parameters()}
        slots = []
        for bucket, master in zip(self.buckets.buckets, self.masters):
            for position, start, end, at in bucket.layout.pieces(self.group.rank, self.group.size):
                p = bucket.params[position]
                slots.append(StateSlot(names[id(p)], tuple(p.shape), start, end, master.detach()[at : at + end - start],
                                       True, master, at))
        in_buckets = {id(p) for b in self.buckets.buckets for p in b.params}
        slots += [StateSlot(n, tuple(p.shape), 0, p.numel(), p.detach().view(-1), False, replica=self.group.rank)
                  for n, p in self.module.named_parameters() if id(p) not in in_buckets]
        return slots

    def resident(self) -> contextlib.AbstractContextManager:
        return self.offload.resident()

    def after_state_load(self) -> None:
        for i in range(len(self.masters)):
            self._write_back(i)
        self._all_gather_params()

    @property
    def swaps_to_disk(self) -> bool:
        return self.offload.swaps_to_disk

    def model_state_tensors(self) -> ModelStateTensors:
        params = [p for b in self.buckets.buckets for p in b.params]
        frozen = [p for p in self.module.parameters() if not p.requires_grad]
        return ModelStateTensors(params, frozen, self.buckets.shard_grads(), list(self.masters),
                                 optimizer_offloaded=self.offload.offloaded, params_offloaded=False)

    def close(self) -> None:
        self.offload.close()


def _trainable_groups(param_groups: list[dict[str, Any]], trainable: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    """Each optimizer group's trainable parameters; a parameter in two groups is a user error."""
    trainable_ids = {id(p) for p in trainable}
    seen: set[int] = set()
    groups = []
    for index, group in enumerate(param_groups):
        params = []
        for p in group["params"]:
            if id(p) not in trainable_ids:
                continue
            if id(p) in seen:
                raise ValueError(f"optimizer param group {index}: a parameter of shape {tuple(p.shape)} is also in an "
                                 "earlier group; each parameter may belong to one group only.")
            seen.add(id(p))
            params.append(p)
        groups.append(params)
    return groups
