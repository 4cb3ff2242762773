"""The activations peak: saved-for-backward bytes of the largest forward.

[Note: activation bytes] Activations are the tensors autograd saves for backward. While tracking is
on, a saved-tensors hook records each one's storage during forward; the sum (parameters excluded, each
storage once) of the largest forward seen is the activations peak. Tracking costs a Python call per
saved tensor, so it runs only with `memory_breakdown: true`.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Iterator

import torch

from .noop import NOTHING


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Identifies a tensor's storage: views of one buffer share it."""
    return (t.device.type, t.untyped_storage().data_ptr())


def is_parameter(t: torch.Tensor) -> bool:
    """A parameter or a view of one (a transposed weight): at ZeRO-3 the parameter's storage is gathered
    during forward, after the tracker listed the parameters' storages, so the storage alone cannot tell."""
    return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)


class ActivationTracker:
    """Measures saved-for-backward bytes per forward (see [Note: activation bytes])."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.peak: int | None = None

    def track(self, module: torch.nn.Module) -> ContextManager[None]:
        return self._tracked(module) if self.enabled else NOTHING

    @contextlib.contextmanager
    def _tracked(self, module: torch.nn.Module) -> Iterator[None]:
        params = {storage_key(p) for p in module.parameters()}
        seen: dict[tuple[str, int], int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = storage_key(t)
            if key not in params and not is_parameter(t):
                seen[key] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.peak = max(self.peak or 0, sum(seen.values()))
