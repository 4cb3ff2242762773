"""The activations peak: saved-for-backward bytes of the largest forward.

[Note: activation bytes] Activations are the tensors autograd saves for backward. While tracking is
on, a saved-tensors hook records each one's storage during forward; the sum (parameters excluded, each
storage once) of the largest forward seen is the activations peak. Tracking costs a Python call per
saved tensor, so it runs for every forward only with `memory_breakdown: true`; otherwise for the first
forward that builds a graph, which is what the out-of-memory explainer (planner/oom.py) needs. A forward
that raises (out of memory, say) leaves what it had saved so far in `partial`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator

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
        self.partial: int | None = None
        """Saved bytes of a first forward that raised before it finished (an out-of-memory error, say)."""
        self.partial_share: float | None = None
        """The share of the modules holding parameters that the failed forward had entered."""

    @property
    def wanted(self) -> bool:
        """Whether the next forward is tracked: always when enabled, else until one forward has been."""
        return self.enabled or self.peak is None

    def track(self, module: torch.nn.Module) -> ContextManager[None]:
        return self._tracked(module) if self.wanted and torch.is_grad_enabled() else NOTHING

    @contextlib.contextmanager
    def _tracked(self, module: torch.nn.Module) -> Iterator[None]:
        params = {storage_key(p) for p in module.parameters()}
        seen: dict[tuple[str, int], int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = storage_key(t)
            if key not in params and not is_parameter(t):
                seen[key] = t.untyped_storage().nbytes()
            return t

        with contextlib.ExitStack() as stack:
            entered = stack.enter_context(_entered_modules(module)) if self.peak is None else None
            try:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    yield
            except BaseException:
                if entered is not None:
                    self.partial, self.partial_share = sum(seen.values()), entered()
                raise
        self.peak = max(self.peak or 0, sum(seen.values()))


@contextlib.contextmanager
def _entered_modules(root: torch.nn.Module) -> Iterator[Callable[[], float]]:
    """Yields a function giving the share of `root`'s modules with parameters of their own whose forward has
    begun: how far a forward got before it failed."""
    owners = {id(m) for m in root.modules() if next(m.parameters(recurse=False), None) is not None}
    entered: set[int] = set()

    def pre_hook(module: torch.nn.Module, args: Any) -> None:
        if id(module) in owners:
            entered.add(id(module))

    handle = torch.nn.modules.module.register_module_forward_pre_hook(pre_hook)
    try:
        yield lambda: len(entered) / max(len(owners), 1)
    finally:
        handle.remove()
