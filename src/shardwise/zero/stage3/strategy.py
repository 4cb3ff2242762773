"""ZeRO stage 3: parameters, gradients and optimizer state all partitioned across data-parallel ranks.

Each rank holds 1/N of every unit (see `unit.py`); full parameters exist only while the module that
needs them runs (`hooks.py`). Gradients are reduce-scattered per unit as soon as the unit's
gradients are complete (the partitioned gradient buckets of stage 2, one bucket per unit). After the
optimizer step the updated slices simply stay where they are: the next forward gathers them.

`reduce_bucket_size` is not used at stage 3: a unit's gradients are reduce-scattered in one call as
soon as they are complete, so the unit (a module's parameters) is the bucket. Where the ranks share memory,
consecutive units are launched in groups of `COALESCE_BUCKET_BYTES` whose reductions share one stream
([Note: launch groups] in `grad_buckets.py`).

Frozen parameters are partitioned over the data-parallel ranks of one node only when the data group spans
nodes (`node_local_frozen_weights`): a whole copy per node, so the network between nodes carries only what
trains. ZeRO++ (`zero_hpz_partition_size`, `zero_quantized_weights`, `zero_quantized_gradients`) changes
how the hooks' gathers and the gradient reduce-scatter travel (`unit.py`, [Note: approximate gathers]).

`module.state_dict()` does not communicate at stage 3: it returns what this rank holds, whole values for
gathered parameters and empty placeholders (with a warning) for partitioned ones, so that a rank calling it
alone cannot hang; `consolidated_state_dict` is the collective that returns whole weights on rank 0
([Note: state_dict() at stage 3] in `state_dict.py`).
"""

from __future__ import annotations

import contextlib
import logging

import torch

from ...config.notes import note_once, note_once_per_job
from ...config.sections import ZeroConfig
from ...distributed.topology import DataSplit
from ...offload import make_optimizer_offload, make_param_home
from ...protocols import ModelStateTensors, NoRankLocalState, StateSlot, StrategyInputs
from ..grad_buckets import COALESCE_BUCKET_BYTES, Bucket, BucketedGrads, GradBuckets
from ..quantize import BlockQuant
from ..quantized_comm import QuantizedReduceScatter
from ..reducers import AllReduceMean, GradAveraging, ReduceScatterMean
from .build import build_unit, coalesce_persistent, plan_units, units_by_module
from .hooks import Stage3Hooks
from .init import check_shapes
from .leaf import set_leaves_by_granularity
from .state_dict import LocalStateDict, consolidated_state_dict
from .unit import LiveParams, ParamUnit


WEIGHT_QUANT = BlockQuant(bits=8, block=256)
"""qwZ: DeepSpeed's ZeRO++ gathers weights as int8 with a scale per block."""
GRAD_QUANT = BlockQuant(bits=4, block=256)
"""qgZ: and reduces gradients as 4-bit values (an fp32 gradient travels in 0.52 bytes per element)."""


logger = logging.getLogger(__name__)

_WHOLE = 1 << 62
"""A persistence threshold no unit reaches."""


class Stage3(NoRankLocalState, BucketedGrads):
    reduces_every_micro_step = True

    def __init__(self, inputs: StrategyInputs):
        self.module, self.precision, self.group, self.comm = inputs.module, inputs.precision, inputs.dp_group, inputs.comm
        zero = inputs.zero
        self.live = LiveParams()
        device = _device_of(self.module)
        self.offload = make_optimizer_offload(zero.offload_optimizer, zero.sub_group_size, self.group.rank, inputs.aio)
        self.param_home = make_param_home(zero.offload_param, self.group.rank, inputs.aio)
        self.units: list[ParamUnit] = []
        self.unit_group: dict[int, int] = {}
        if zero.stage3_module_granularity_threshold > 0:
            _leaves_by_granularity(self.module, zero.stage3_module_granularity_threshold)
        plans = coalesce_persistent(plan_units(self.module, inputs.param_groups), self._persistence(zero))
        for module_name, group_index, named, persistent in plans:
            frozen_on_node = group_index < 0 and zero.node_local_frozen_weights
            node = inputs.node_split if frozen_on_node else None
            unit = build_unit(len(self.units), module_name, named, self.precision, self.comm,
                              node.group if node else self.group, self.live, device, persistent,
                              trainable=group_index >= 0, offload=self.offload, home=self.param_home)
            if node is not None:
                unit.replica = node.index
            else:
                unit.secondary_group = inputs.hpz_split.group if inputs.hpz_split and not persistent else None
                unit.quant = WEIGHT_QUANT if zero.zero_quantized_weights else None
            self.units.append(unit)
            self.unit_group[unit.index] = group_index
        if self.precision.casts_module:
            self.module.to(dtype=self.precision.param_dtype)  # buffers; parameters are placeholders now
        self.trainable = [u for u in self.units if u.master is not None]
        self._transient = [u for u in self.units if not u.persistent]
        averaging = GradAveraging.make(self.group.size, inputs.prescale_gradients, inputs.gradient_predivide_factor)
        alone = self.group.size == 1  # whole buckets, nothing to reduce ([Note: a data-parallel group of one])
        if alone:
            reducer = AllReduceMean(self.comm, self.group, averaging, self.precision.reduce_dtype)
        elif _quantize_gradients(zero.zero_quantized_gradients, inputs.node_split):
            reducer = QuantizedReduceScatter(self.comm, self.group, averaging, GRAD_QUANT)
        else:
            reducer = ReduceScatterMean(self.comm, self.group, averaging, self.precision.reduce_dtype, accumulate=True)
        buckets = [Bucket(u.layout, u.params, self.precision.grad_accum_dtype, u.layout.shard_range(self.group.rank, self.group.size),
                          partitioned=not alone) for u in reversed(self.trainable)]
        self._bucket_unit = list(reversed(self.trainable))
        streams = self.comm.streams_coalesced(self.group, device)
        coalesce = COALESCE_BUCKET_BYTES // self.precision.grad_accum_dtype.itemsize if streams else 0
        self._in_place = all(u.whole and u.persistent for u in self.units)
        """[Note: a unit of one] for every unit: nothing to release after backward, to discard or gather after a step."""
        self.buckets = GradBuckets(buckets, reducer, overlap=zero.overlap_comm,
                                   on_complete=None if self._in_place else self._grads_complete,
                                   counts_in_norm=inputs.counts_in_norm, coalesce_numel=coalesce,
                                   grads_in_place=self._in_place)
        self.hooks = None if all(u.persistent for u in self.units) else Stage3Hooks(
            self.module, units_by_module(self.module, self.units), self.live, zero.stage3_prefetch_bucket_size,
            zero.stage3_max_live_parameters, zero.stage3_max_reuse_distance)
        """None when every unit stays gathered: nothing to gather before a module runs or release after."""
        self._gather_persistent()
        groups = [{**g, "params": []} for g in inputs.param_groups]
        for unit in self.trainable:
            groups[self.unit_group[unit.index]]["params"].append(unit.master)
        self.optimizer = inputs.make_optimizer(groups)  # every group, in order: a client optimizer's map by position
        if self.optimizer is not None:
            # then only those with a trainable parameter, as DeepSpeed's ZeRO-3 optimizer holds: a scheduler's or a
            # Trainer's saved state (one lr per group) carries between the two
            self.optimizer.param_groups[:] = [g for g in self.optimizer.param_groups if g["params"]]
        self.offload.bind(self.optimizer)
        self.local_state_dict = LocalStateDict(self.module)

    def _persistence(self, zero: ZeroConfig) -> int:
        """The persistence threshold; in a group of one with the parameters on the device every unit is persistent
        ([Note: a unit of one]: the slice is the whole, so keeping it gathered costs no memory and no copy, and the
        modules need no hooks), as FSDP keeps a world of one unsharded."""
        if self.group.size > 1 or self.param_home.offloaded:
            return zero.stage3_param_persistence_threshold
        return _WHOLE

    @property
    def masters(self) -> list[torch.Tensor]:
        return [u.master for u in self.trainable]

    def _grads_complete(self, bucket_index: int) -> None:
        self._bucket_unit[bucket_index].release()

    def _gather_persistent(self) -> None:
        persistent = [u for u in self.units if u.persistent]
        for unit in persistent:
            unit.gather_async()
        for unit in persistent:
            unit.wait()

    def begin_backward(self, reduce: bool) -> None:
        self.buckets.begin(True)
        if self.hooks is not None:
            self.hooks.in_backward = True

    def finish_backward(self) -> None:
        self.buckets.finish()
        if self.hooks is not None:
            self.hooks.in_backward = False
            self.hooks.end_backward()
        for unit in self._transient:
            unit.release()

    def optimizer_step(self) -> None:
        grads = {id(u): b.shard_grad for b, u in zip(self.buckets.buckets, self._bucket_unit)}
        with torch.no_grad():
            self.offload.step(self.optimizer, self.masters, [grads[id(u)] for u in self.trainable],
                              lambda i: self.trainable[i].write_back())
        if self._in_place:
            return
        for unit in self.trainable:  # every gathered copy is stale now
            unit.discard_gathered()
        self._gather_persistent()

    def sync_params(self) -> None:
        """Nothing to gather: every rank already holds what it stepped (stage 0), or gathers on use (stage 3)."""

    def explain_forward_error(self, error: BaseException) -> str | None:
        """The error with an explanation when the failing forward held parameters that were partitioned (the
        hooks record them as the error passes, `hooks.FailedForward`); None when it did not."""
        failure = self.hooks and self.hooks.failure
        if failure is None or failure.error_id != id(error) or not failure.partitioned:
            return None
        names = ", ".join(failure.partitioned[:5]) + (" ..." if len(failure.partitioned) > 5 else "")
        return (f"{error}\nZeRO-3: the forward of {failure.module!r} used {names} while partitioned (each rank keeps "
                "only a slice between uses; the tensor it got is an empty placeholder). shardwise gathers a parameter "
                "that a forward reads as a module attribute (self.proj.weight), not one reached another way (kept in a "
                "list or a closure, from named_parameters()). Read it as an attribute, or declare it before initialize: "
                "shardwise.zero.register_external_parameter(reading_module, parameter), or "
                "shardwise.zero.set_z3_leaf_modules(model, [ReadingModuleClass]) to gather a module's whole subtree "
                "at its forward; or read it inside shardwise.zero.GatheredParameters([parameter]).")

    # --- module state -----------------------------------------------------------------------
    def consolidated_state_dict(self, exclude_frozen: bool = False) -> dict[str, torch.Tensor] | None:
        """Whole weights in the training dtype on rank 0 (None elsewhere); every rank must call it."""
        return consolidated_state_dict(self.module, self.group.rank, exclude_frozen)

    def load_module_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Stream full weights into the slices: each rank keeps the part of each tensor it owns."""
        names = {n for u in self.units for n in u.names}
        _check_names(names, set(state), strict)
        check_shapes("load_module_state_dict", {n: s for u in self.units for n, s in zip(u.names, u.shapes)}, state)
        with self.resident(), torch.no_grad():
            for unit in self.units:
                target = unit.master if unit.master is not None else unit.shard
                for position, start, end, at in unit.layout.pieces(unit.group.rank, unit.group.size):
                    name = unit.names[position]
                    if name in state:
                        target[at : at + end - start] = state[name].reshape(-1)[start:end]
                unit.write_back()
                unit.discard_gathered()
        buffers = {k: v for k, v in state.items() if k not in names}
        self.module.load_state_dict(buffers, strict=False)
        self._gather_persistent()

    # --- checkpoints -------------------------------------------------------------------------
    def state_slots(self) -> list[StateSlot]:
        slots = []
        for unit in self.units:
            source = unit.master.detach() if unit.master is not None else unit.shard
            for position, start, end, at in unit.layout.pieces(unit.group.rank, unit.group.size):
                slots.append(StateSlot(unit.names[position], tuple(unit.shapes[position]), start, end,
                                       source[at : at + end - start], unit.master is not None, unit.master, at,
                                       replica=unit.replica))
        return slots

    def resident(self) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        stack.enter_context(self.offload.resident())
        stack.enter_context(self.param_home.resident(self.units))
        return stack

    def after_state_load(self) -> None:
        with torch.no_grad():
            for unit in self.trainable:
                unit.write_back()
        for unit in self.units:
            unit.discard_gathered()
        self._gather_persistent()

    @property
    def swaps_to_disk(self) -> bool:
        return self.offload.swaps_to_disk or self.param_home.swaps_to_disk

    def model_state_tensors(self) -> ModelStateTensors:
        def stored(units: list[ParamUnit]) -> list[torch.Tensor]:  # slices, whole copies kept resident, hpZ blocks
            return ([u.shard for u in units] + [u.full for u in units if u.persistent and not u.whole]
                    + [u.secondary for u in units if u.secondary is not None])

        frozen = [u for u in self.units if u.master is None]
        return ModelStateTensors(stored(self.trainable), stored(frozen), self.buckets.shard_grads(), self.masters,
                                 optimizer_offloaded=self.offload.offloaded, params_offloaded=self.param_home.offloaded)

    def close(self) -> None:
        self.offload.close()
        self.param_home.close()


def _leaves_by_granularity(module: torch.nn.Module, threshold: int) -> None:
    """stage3_module_granularity_threshold: mark the leaves, and say what it did (DeepSpeed says both too)."""
    marked, smallest = set_leaves_by_granularity(module, threshold)
    key = f"zero_optimization.stage3_module_granularity_threshold={threshold}"
    if not marked:
        note_once_per_job(logger, logging.WARNING, f"{key} marks no module: the smallest granularity in this model is "
                          f"{smallest} elements per layer; set it to at least that for an effect, or mark leaves by "
                          "class with shardwise.zero.set_z3_leaf_modules.")
        return
    names = {id(m): name or "<root>" for name, m in module.named_modules()}
    shown = ", ".join(names[id(m)] for m in marked[:5]) + (", ..." if len(marked) > 5 else "")
    note_once_per_job(logger, logging.INFO, f"{key}: {len(marked)} module(s) gathered whole as ZeRO-3 leaves ({shown})")


def _quantize_gradients(asked: bool, node_split: DataSplit | None) -> bool:
    """qgZ saves bytes on the links between nodes; on one node there is none, and DeepSpeed reduces exactly there."""
    if asked and node_split is None:
        note_once(logger, logging.INFO, "zero_optimization.zero_quantized_gradients: the data-parallel ranks are on one "
                  "node, so gradients are reduced exactly, as DeepSpeed does (4-bit blocks only cross nodes).")
    return asked and node_split is not None


def _device_of(module: torch.nn.Module) -> torch.device:
    return next(module.parameters(), torch.empty(0)).device


def _check_names(expected: set[str], given: set[str], strict: bool) -> None:
    missing = sorted(expected - given)  # extra names are buffers, loaded separately
    if strict and missing:
        raise KeyError(f"load_module_state_dict: missing parameters {missing[:10]}{' ...' if len(missing) > 10 else ''}.")
