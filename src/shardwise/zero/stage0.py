"""ZeRO stage 0: plain data parallelism.

Every rank holds the whole model and optimizer state. Gradients accumulate in fp32 buckets and are
all-reduced (averaged) during the backward of the last micro-step. With fp16/bf16 the module computes
in 16 bits while fp32 master copies are what the optimizer updates; with fp32 the module's own
parameters are the masters (no copy).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..protocols import ModelStateTensors, NoRankLocalState, ParamGroups, StateSlot, StrategyInputs
from .edits import register_replicated, take_edits
from .grad_buckets import BucketedGrads, GradBuckets
from .reducers import AllReduceMean, GradAveraging


def trainable_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Parameters that receive gradients, each once (tied parameters appear once), in module order."""
    return [p for p in module.parameters() if p.requires_grad]


def whole_state_dict(module: torch.nn.Module, exclude_frozen: bool) -> dict[str, torch.Tensor] | None:
    """`module.state_dict()` on global rank 0 (less frozen parameters), None elsewhere: for strategies whose
    every rank holds whole parameters."""
    if dist.get_rank() != 0:
        return None
    frozen = {n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in module.state_dict().items() if not (exclude_frozen and k in frozen)}


def _map_groups(groups: ParamGroups, masters: dict[int, torch.Tensor]) -> ParamGroups:
    """The same groups with each trainable parameter replaced by its master; frozen ones dropped."""
    mapped = []
    for group in groups:
        params = [masters[id(p)] for p in group["params"] if id(p) in masters]
        if params:
            mapped.append({**group, "params": params})
    return mapped


class DataParallel(NoRankLocalState, BucketedGrads):
    reduces_every_micro_step = False
    swaps_to_disk = False

    def __init__(self, inputs: StrategyInputs):
        module, precision = inputs.module, inputs.precision
        self.module = module
        self.precision = precision
        self.group = inputs.dp_group
        self.comm = inputs.comm
        self.params = trainable_parameters(module)
        if precision.mixed:
            # Masters come from the fp32 weights before the module is cast, so nothing is rounded away.
            self.masters = [torch.nn.Parameter(p.detach().to(precision.master_dtype).clone()) for p in self.params]
            module.to(dtype=precision.param_dtype)
        else:
            self.masters = self.params
        master_of = {id(p): m for p, m in zip(self.params, self.masters)}
        self.optimizer = inputs.make_optimizer(_map_groups(inputs.param_groups, master_of))
        averaging = GradAveraging.make(inputs.dp_group.size, inputs.prescale_gradients, inputs.gradient_predivide_factor)
        reducer = AllReduceMean(inputs.comm, inputs.dp_group, averaging, precision.reduce_dtype)
        self.buckets = GradBuckets.replicated(self.params, inputs.zero.reduce_bucket_size, precision.grad_accum_dtype,
                                              reducer, overlap=inputs.zero.overlap_comm,
                                              counts_in_norm=inputs.counts_in_norm)
        views = {id(p): b.slot_view(i).view_as(p) for b in self.buckets.buckets for i, p in enumerate(b.params)}
        self._grad_views = [views[id(p)] for p in self.params]
        register_replicated(module.parameters(), self)

    def begin_backward(self, reduce: bool) -> None:
        self.buckets.begin(reduce)

    def optimizer_step(self) -> None:
        for master, view in zip(self.masters, self._grad_views):
            master.grad = view if view.dtype == master.dtype else view.to(master.dtype)
        self.optimizer.step()
        for master in self.masters:
            master.grad = None
        if self.precision.mixed:
            with torch.no_grad():
                torch._foreach_copy_([p.data for p in self.params], self.masters)

    def sync_params(self) -> None:
        """Nothing to gather: every rank already holds what it stepped (stage 0), or gathers on use (stage 3)."""

    def keep_edits(self, params: list[torch.nn.Parameter], src: int) -> None:
        """Rank `src`'s values of `params` everywhere and in their masters ([Note: edits reach the masters])."""
        for p in params:
            self.comm.broadcast(p.data, src, self.group).wait()
        if self.precision.mixed:
            master_of = {id(p): m for p, m in zip(self.params, self.masters)}
            for p in params:
                if id(p) in master_of:
                    take_edits(master_of[id(p)], p)

    def explain_forward_error(self, error: BaseException) -> str | None:
        return None  # the module holds its whole parameters: nothing of ours can be the cause

    def consolidated_state_dict(self, exclude_frozen: bool = False) -> dict[str, torch.Tensor] | None:
        return whole_state_dict(self.module, exclude_frozen)

    def load_module_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        self.module.load_state_dict(state, strict=strict)
        if self.precision.mixed:
            with torch.no_grad():
                torch._foreach_copy_(self.masters, [p.data for p in self.params])

    def state_slots(self) -> list[StateSlot]:
        names = {id(p): n for n, p in self.module.named_parameters()}
        slots = [StateSlot(names[id(p)], tuple(p.shape), 0, p.numel(), m.detach().view(-1), True, m, replica=self.group.rank)
                 for p, m in zip(self.params, self.masters)]
        trainable = {id(p) for p in self.params}
        slots += [StateSlot(n, tuple(p.shape), 0, p.numel(), p.detach().view(-1), False, replica=self.group.rank)
                  for n, p in self.module.named_parameters() if id(p) not in trainable]
        return slots

    def resident(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def after_state_load(self) -> None:
        if self.precision.mixed:
            with torch.no_grad():
                torch._foreach_copy_([p.data for p in self.params], self.masters)

    def model_state_tensors(self) -> ModelStateTensors:
        frozen = [p for p in self.module.parameters() if not p.requires_grad]
        return ModelStateTensors(list(self.params), frozen, self.buckets.shard_grads(), list(self.masters),
                                 optimizer_offloaded=False, params_offloaded=False)

    def close(self) -> None:
        """Nothing lives outside memory."""
