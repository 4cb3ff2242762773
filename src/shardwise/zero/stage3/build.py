"""Turn a module's parameters into sharded units: which parameters share a unit, and each rank's slice.

A unit is the direct parameters of one module that share an optimizer group and trainability (so a
unit's master slice belongs to one optimizer group). A tied parameter belongs to the first module
that holds it; other modules holding it gather the owner's unit. The exception: units below the
persistence threshold are merged into one persistent unit per optimizer group (`coalesce_persistent`).
"""

from __future__ import annotations

from typing import Any

import torch

from ...distributed import Collectives, Group
from ...precision import PrecisionPolicy
from ..flat_param import BucketLayout, plan_buckets
from .ds_attributes import mark_partitioned
from .leaf import outermost_leaves
from .registry import EXTERNAL_PARAMS, INIT_SHARD_OF, UNIT_OF
from .unit import LiveParams, ParamUnit

_NO_CAP = 1 << 62


def _group_index(param_groups: list[dict[str, Any]]) -> dict[int, int]:
    index = {}
    for i, group in enumerate(param_groups):
        for p in group["params"]:
            index.setdefault(id(p), i)
    return index


def plan_units(module: torch.nn.Module, param_groups: list[dict[str, Any]]) -> list[tuple[str, int, list[tuple[str, torch.nn.Parameter]]]]:
    """(module name, optimizer group or -1 for frozen, [(param name, param)]) for every unit, in module order."""
    group_of = _group_index(param_groups)
    owned: set[int] = set()
    plans = []
    for mod_name, mod in module.named_modules():
        by_key: dict[int, list[tuple[str, torch.nn.Parameter]]] = {}
        for name, p in mod.named_parameters(recurse=False):
            if id(p) in owned:
                continue
            owned.add(id(p))
            key = group_of.get(id(p), -1) if p.requires_grad else -1
            full_name = f"{mod_name}.{name}" if mod_name else name
            by_key.setdefault(key, []).append((full_name, p))
        plans += [(mod_name, key, params) for key, params in by_key.items()]
    return plans


def _shape(p: torch.nn.Parameter) -> torch.Size:
    """The parameter's whole shape, also when `zero.Init` has already partitioned it."""
    return INIT_SHARD_OF[p].shape if p in INIT_SHARD_OF else p.shape


def coalesce_persistent(plans: list[tuple[str, int, list[tuple[str, torch.nn.Parameter]]]], threshold: int
                        ) -> list[tuple[str, int, list[tuple[str, torch.nn.Parameter]], bool]]:
    """The plans with a persistence flag; units below `threshold` elements (norms, biases) stay whole on every
    rank, and all of one optimizer group become one unit, first: gathered after a step and reduced after
    backward in one collective each instead of one per module (a 27-layer GPT has 165 of them). First,
    because gradient buckets launch in reverse unit order and this one's gradients are complete only at the
    end of backward; placed anywhere else it would hold back every bucket behind it."""
    merged: dict[int, list[tuple[str, torch.nn.Parameter]]] = {}
    rest = []
    for module_name, key, named in plans:
        if sum(_shape(p).numel() for _, p in named) < threshold:
            merged.setdefault(key, []).extend(named)
        else:
            rest.append((module_name, key, named, False))
    return [("<persistent>", key, named, True) for key, named in merged.items()] + rest


def _full_values(p: torch.nn.Parameter, comm: Collectives, group: Group, device: torch.device) -> torch.Tensor:
    """The whole parameter, flat, in fp32: from its data, or gathered from its `zero.Init` shards."""
    init = INIT_SHARD_OF.pop(p, None)
    if init is None:
        return p.detach().reshape(-1).to(device=device, dtype=torch.float32)
    return init.gather().reshape(-1).to(device=device, dtype=torch.float32)


def build_unit(index: int, module_name: str, named: list[tuple[str, torch.nn.Parameter]], precision: PrecisionPolicy,
               comm: Collectives, group: Group, live: LiveParams, device: torch.device,
               persistent: bool, trainable: bool, offload: Any, home: Any) -> ParamUnit:
    """Fill this rank's slice one parameter at a time (peak: the slice plus one whole parameter)."""
    names, params = [n for n, _ in named], [p for _, p in named]
    shapes = [_shape(p) for p in params]
    layout: BucketLayout = plan_buckets([s.numel() for s in shapes], _NO_CAP, align=group.size)[0]
    lo, hi = layout.shard_range(group.rank, group.size)
    master = torch.zeros(hi - lo, dtype=precision.master_dtype, device=device)
    for slot, p in zip(layout.slots, params):
        values = _full_values(p, comm, group, device)  # a collective: every rank, whatever it keeps
        start, end, at = layout.owned(slot, group.rank, group.size)
        master[at : at + end - start] = values[start:end]
    master_param = offload.home(master) if trainable else None
    # Masters in the parameters' dtype (fp32, or bf16 with bf16_master_weights_and_grads) on the device: the
    # slice the optimizer updates is the very one that is all-gathered (no copy).
    shard = master.to(precision.param_dtype) if precision.mixed else master
    aliased = master_param is not None and master_param.data_ptr() == shard.data_ptr()
    unit = ParamUnit(index, module_name, params, names, shapes, layout, home.keep(index, shard), group, comm, live,
                     persistent=persistent, master=master_param, home=home,
                     aliased=aliased and not home.offloaded, offload=offload, device=device,
                     whole=group.size == 1 and not home.offloaded)
    for p in params:
        UNIT_OF[p] = unit
        mark_partitioned(p)
    return unit


def _read_by(module: torch.nn.Module, leaf: bool) -> list[torch.nn.Parameter]:
    """The parameters `module`'s forward may read: its own (its subtree's for a leaf) and registered external ones."""
    modules = list(module.modules()) if leaf else [module]
    return [p for m in modules for p in [*m.parameters(recurse=False), *EXTERNAL_PARAMS.get(m, [])]]


def units_by_module(module: torch.nn.Module, units: list[ParamUnit]) -> dict[torch.nn.Module, list[ParamUnit]]:
    """The units each module needs: those owning its direct parameters and its registered external ones; a leaf
    module (`leaf.py`) needs its whole subtree's, and its descendants get no entry (no hooks)."""
    needs: dict[torch.nn.Module, list[ParamUnit]] = {}
    leaves = {id(leaf): leaf for leaf in outermost_leaves(module)}
    inside_leaf = {id(m) for leaf in leaves.values() for m in leaf.modules() if m is not leaf}
    for mod in module.modules():
        if id(mod) in inside_leaf:
            continue
        found: list[ParamUnit] = []
        for p in _read_by(mod, id(mod) in leaves):
            unit = UNIT_OF.get(p)
            if unit is not None and all(unit is not u for u in found):
                found.append(unit)
        if found:
            needs[mod] = found
    return needs
