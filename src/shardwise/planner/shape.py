"""What the planner knows of a model: parameter counts (`ModelShape`) and one traced micro-batch's
activations (`ActivationProfile`). Both are plain numbers that travel as JSON, so `shardwise autotune` can
profile a model once, in the user's own script, and plan every candidate config from the file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..profiling.activations import storage_key


def _numel(p: torch.Tensor) -> int:
    """A parameter's whole element count, also when ZeRO-3 left a placeholder in the module."""
    return int(getattr(p, "ds_numel", p.numel()))


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

    @classmethod
    def of(cls, module: torch.nn.Module) -> ModelShape:
        params = list(dict.fromkeys(module.parameters()))  # a tied parameter once
        sizes = [sum(_numel(p) for p in m.parameters(recurse=False)) for m in module.modules()]
        return cls(trainable=sum(_numel(p) for p in params if p.requires_grad),
                   frozen=sum(_numel(p) for p in params if not p.requires_grad),
                   param_bytes=params[0].element_size() if params else 4,
                   module_sizes=tuple(s for s in sizes if s))

    @property
    def total(self) -> int:
        return self.trainable + self.frozen

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelShape:
        return cls(**{**data, "module_sizes": tuple(data.get("module_sizes", ()))})


@dataclass(frozen=True)
class ActivationProfile:
    saved_bytes: int
    """Bytes autograd saved for backward over one forward of the traced micro-batch (parameters excluded)."""
    micro_batch: int
    """Samples in the traced micro-batch."""
    seq_len: int | None = None
    """Its sequence length, when the batch has one (the second dimension of its token ids)."""

    def scaled(self, micro_batch: int, seq_len: int | None = None) -> int:
        """Saved bytes at another micro-batch (linear) and sequence length (linear: attention through SDPA
        keeps no [S, S] scores)."""
        per_sample = self.saved_bytes / self.micro_batch
        stretch = seq_len / self.seq_len if seq_len and self.seq_len else 1.0
        return int(per_sample * micro_batch * stretch)

    @classmethod
    def trace(cls, forward: Callable[[], Any], module: torch.nn.Module, micro_batch: int,
              seq_len: int | None = None) -> ActivationProfile:
        """Run `forward()` (which calls `module`) once, counting what autograd saves."""
        params = {storage_key(p) for p in module.parameters()}
        saved: dict[tuple[str, int], int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = storage_key(t)
            if key not in params and t.device.type != "meta":
                saved[key] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward()
        return cls(saved_bytes=sum(saved.values()), micro_batch=micro_batch, seq_len=seq_len)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ActivationProfile:
        return cls(**data)
