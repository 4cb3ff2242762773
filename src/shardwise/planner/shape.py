"""What the planner knows of a model: parameter counts (`ModelShape`) and one traced micro-batch's
activations (`ActivationProfile`). Both are plain numbers that travel as JSON, so `shardwise autotune` can
profile a model once, in the user's own script, and plan every candidate config from the file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..profiling.activations import is_parameter, storage_key
from ..profiling.memory import whole_numel


def _saved_key(t: torch.Tensor) -> Any:
    """One key per storage; meta tensors have no storage address, so there the base tensor stands for it."""
    if t.device.type == "meta":
        return ("meta", id(t._base if t._base is not None else t))
    return storage_key(t)


def _saved_bytes(t: torch.Tensor) -> int:
    if t.device.type == "meta":
        base = t._base if t._base is not None else t
        return base.numel() * base.element_size()
    return t.untyped_storage().nbytes()


@dataclass(frozen=True)
class ModelShape:
    trainable: int
    """Elements of the parameters that train."""
    frozen: int = 0
    """Elements of those that do not (a LoRA fine-tune's base model)."""
    param_bytes: int = 4
    """Bytes per element of the parameters as the model was built (before the engine casts them)."""
    module_sizes: tuple[int, ...] = ()
    """Elements owned directly by each module with parameters, in registration order: ZeRO-3 gathers
    parameters module by module, so its live window is counted in these units."""
    leaf_groups: tuple[tuple[int, ...], ...] = ()
    """Per ZeRO-3 leaf module marked on the model (zero/stage3/leaf.py: by class, or by granularity once an
    engine marked them), the `module_sizes` of its subtree: a leaf's forward gathers them all at once."""
    granularity_groups: tuple[tuple[int, tuple[int, ...]], ...] = ()
    """Per module that `stage3_module_granularity_threshold` may make a leaf: (its granularity, the
    `module_sizes` of its subtree), so that a plan knows the leaves a threshold will mark before any engine
    has marked them ([Note: leaves by granularity])."""

    @classmethod
    def of(cls, module: torch.nn.Module) -> ModelShape:
        from ..zero.stage3.leaf import granularities, outermost_leaves

        params = list(dict.fromkeys(module.parameters()))  # a tied parameter once

        def sizes(modules: Any) -> tuple[int, ...]:
            return tuple(s for s in (sum(whole_numel(p) for p in m.parameters(recurse=False)) for m in modules) if s)

        candidates = granularities(module)
        return cls(trainable=sum(whole_numel(p) for p in params if p.requires_grad),
                   frozen=sum(whole_numel(p) for p in params if not p.requires_grad),
                   param_bytes=params[0].element_size() if params else 4,
                   module_sizes=sizes(module.modules()),
                   leaf_groups=tuple(group for leaf in outermost_leaves(module) if (group := sizes(leaf.modules()))),
                   granularity_groups=tuple((candidates[id(m)], sizes(m.modules())) for m in module.modules()
                                            if id(m) in candidates))

    def leaf_groups_at(self, granularity_threshold: int) -> tuple[tuple[int, ...], ...]:
        """The marked leaves' groups and those `granularity_threshold` would mark. A module chosen by the
        threshold may lie inside another chosen one (the engine marks only the outermost); its group is then
        part of its ancestor's, so the largest group, which is what a plan needs, is the same."""
        if granularity_threshold <= 0:
            return self.leaf_groups
        return self.leaf_groups + tuple(group for g, group in self.granularity_groups if g <= granularity_threshold)

    @property
    def total(self) -> int:
        return self.trainable + self.frozen

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "leaf_groups": [list(group) for group in self.leaf_groups],
                "granularity_groups": [[g, list(group)] for g, group in self.granularity_groups]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelShape:
        return cls(**{**data, "module_sizes": tuple(data.get("module_sizes", ())),
                      "leaf_groups": tuple(tuple(g) for g in data.get("leaf_groups", ())),
                      "granularity_groups": tuple((g, tuple(group)) for g, group in data.get("granularity_groups", ()))})


@dataclass(frozen=True)
class ActivationProfile:
    saved_bytes: int
    """Bytes autograd saved for backward over one forward of the traced micro-batch (parameters excluded)."""
    micro_batch: int
    """Samples in the traced micro-batch."""
    seq_len: int | None = None
    """Its sequence length, when the batch has one (the second dimension of its token ids)."""
    compute_bytes: int = 4
    """Bytes per element the model computed in when traced (4 fp32, 2 fp16/bf16)."""

    def scaled(self, micro_batch: int, seq_len: int | None = None, compute_bytes: int | None = None) -> int:
        """Saved bytes at another micro-batch (linear), sequence length (linear: attention through SDPA
        keeps no [S, S] scores) and compute width (activations are in the compute dtype)."""
        per_sample = self.saved_bytes / self.micro_batch
        stretch = seq_len / self.seq_len if seq_len and self.seq_len else 1.0
        width = (compute_bytes or self.compute_bytes) / self.compute_bytes
        return int(per_sample * micro_batch * stretch * width)

    @classmethod
    def trace(cls, forward: Callable[[], Any], module: torch.nn.Module, micro_batch: int,
              seq_len: int | None = None) -> ActivationProfile:
        """Run `forward()` (which calls `module`) once, counting what autograd saves."""
        params = {_saved_key(p) for p in module.parameters()}
        saved: dict[Any, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = _saved_key(t)
            if key not in params and not is_parameter(t):
                saved[key] = _saved_bytes(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward()
        width = next((p.element_size() for p in module.parameters() if p.is_floating_point()), 4)
        return cls(saved_bytes=sum(saved.values()), micro_batch=micro_batch, seq_len=seq_len, compute_bytes=width)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ActivationProfile:
        return cls(**data)
