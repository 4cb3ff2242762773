"""The activations peak: saved-for-backward bytes of the largest forward.

[Note: activation bytes] Activations are the tensors autograd saves for backward. While tracking is
on, the graph each module's forward returns is walked when the forward is over, and the storage of every
tensor its nodes saved is recorded; the sum (parameters excluded, each storage once) of the largest
forward seen is the activations peak. Tracking costs Python work per graph node, so it runs for every
forward only with `memory_breakdown: true`; otherwise for the first forward that builds a graph, which
is what the out-of-memory explainer (planner/oom.py) needs. A forward that raises (out of memory, say)
leaves in `partial` what the module forwards it had finished saved.

The graph is read after the fact rather than through a saved-tensors hook because such a hook changes
what backward gets: autograd hands back a new plain tensor for each saved one, so a custom
autograd.Function that saved a parameter no longer finds the parameter (TRL's fused log-prob loss reads
the saved `lm_head.weight`'s ZeRO-3 `ds_status` in its backward). Reading the saved tensors through
`SavedTensor.data` unpacks nothing.
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
        visited: dict[int, Any] = {}

        def read(roots: list[Any]) -> None:
            for t in _saved_tensors(roots, visited):
                key = storage_key(t)
                if key not in params and not is_parameter(t):
                    seen[key] = t.untyped_storage().nbytes()

        with contextlib.ExitStack() as stack:
            entered = stack.enter_context(_entered_modules(module)) if self.peak is None else None
            stack.enter_context(_module_outputs(module, read))
            try:
                yield
            except BaseException:
                if entered is not None:
                    self.partial, self.partial_share = sum(seen.values()), entered()
                raise
        self.peak = max(self.peak or 0, sum(seen.values()))


@contextlib.contextmanager
def _module_outputs(root: torch.nn.Module, read: Callable[[list[Any]], None]) -> Iterator[None]:
    """Calls `read` with the graph nodes of what each of `root`'s modules returns, as each forward ends."""
    mine = {id(m) for m in root.modules()}

    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        if id(module) in mine:
            read([t.grad_fn for t in _tensors(output) if t.grad_fn is not None])

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):  # a ModelOutput too
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


_SAVED_NAMES: dict[type, list[str]] = {}


def _saved_tensors(roots: list[Any], visited: dict[int, Any]) -> Iterator[torch.Tensor]:
    """Every tensor saved by the nodes reachable from `roots` and not in `visited`, as stored (no unpack hook
    runs). `visited` holds the nodes it names until the tracked forward is over, so that an id is not reused."""
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node is None or id(node) in visited:
            continue
        visited[id(node)] = node
        names = _SAVED_NAMES.get(type(node))
        if names is None:
            names = _SAVED_NAMES[type(node)] = [n for n in dir(node) if n.startswith("_raw_saved_")]
        for name in names:
            try:
                value = getattr(node, name)
                items = value if isinstance(value, (list, tuple)) else (value,)
                for item in items:
                    stored = getattr(item, "data", None)
                    yield from (stored,) if isinstance(stored, torch.Tensor) else _checkpoint_inputs(item)
            except RuntimeError:  # freed by a backward that already ran through this part of the graph
                continue
        stack.extend(child for child, _ in node.next_functions)


def _checkpoint_inputs(saved: Any) -> Iterator[torch.Tensor]:
    """What a saved-tensors hook packed in place of a tensor. Under torch's non-reentrant activation checkpointing
    the region's own tensors are recomputed in backward (nothing kept), but its inputs are kept for that: in the
    checkpoint frame (`saved_args`) that the unpack hook closes over. Other hooks (save_on_cpu) keep their tensors
    off the device: none counted."""
    for cell in getattr(getattr(saved, "unpack_hook", None), "__closure__", None) or ():
        try:
            kept = getattr(cell.cell_contents, "saved_args", None)
        except ValueError:  # an empty cell
            continue
        for arg in kept if isinstance(kept, list) else ():
            stored = getattr(arg, "data", None)
            if isinstance(stored, torch.Tensor):
                yield stored


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
