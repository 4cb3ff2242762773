"""Module hooks that gather a module's units just before it runs (forward and backward) and release
them after, with prefetching by the recorded execution order.

Registered in one place (`Stage3Hooks.__init__`), handles kept so `remove()` undoes everything.
Release rules: after a module's forward its units are released unless they are needed again soon
(`max_reuse_distance`); in backward, a unit with trainable parameters is released when all its
gradients have been handed to the gradient buckets, a frozen unit when its module's backward has
produced the gradients of its inputs, and whatever is left at the end of backward.

The root module is always hooked, so that some forward is running whenever the model runs: a parameter
read by a forward that does not hold it is registered with the innermost running module (`reads.py`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from .reads import partitioned_in_frames, unwatch, watch
from .trace import ExecutionTrace
from .unit import LiveParams, ParamUnit, UnitState, gather_units


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return []


class _AfterBackward(torch.autograd.Function):
    """Identity on a module's inputs whose backward runs once the module's backward is done."""

    @staticmethod
    def forward(ctx: Any, hooks: Stage3Hooks, module: torch.nn.Module, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.hooks, ctx.module = hooks, module
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.hooks.post_backward(ctx.module)
        return (None, None, *grads)


@dataclass(frozen=True)
class FailedForward:
    """What a forward that raised had read while partitioned (see `Stage3Hooks._note_failure`)."""

    error_id: int
    module: str
    partitioned: list[str]


class Stage3Hooks:
    def __init__(self, root: torch.nn.Module, units_of: dict[torch.nn.Module, list[ParamUnit]], live: LiveParams,
                 prefetch_numel: int, max_live: int, max_reuse_distance: int):
        units_of.setdefault(root, [])
        self.root, self.units_of, self.live = root, units_of, live
        self.prefetch_numel, self.max_live, self.max_reuse = prefetch_numel, max_live, max_reuse_distance
        self.trace = ExecutionTrace()
        self.in_backward = False
        """Set by the strategy around backward: a forward run then is activation checkpointing's
        recomputation, whose saved tensors the backward is about to read, so it must not release."""
        self._bwd_users: dict[int, int] = {}
        self._all_ahead_fetched: int | None = None
        """The pass in which a prefetch scan last reached the end of the pass with every unit ahead gathered."""
        self.running: list[torch.nn.Module] = []
        """The hooked modules whose forward is under way, outermost first."""
        self.failure: FailedForward | None = None
        self._names = {id(m): name or "<root>" for name, m in root.named_modules()}
        self._unit_of = {id(p): u for units in units_of.values() for u in units for p in u.params}
        self._holds_frozen = {id(m) for m, units in units_of.items() if any(u.master is None for u in units)}
        """The modules with a frozen unit: only their backward is followed by `post_backward`."""
        self._handles = []
        for module in units_of:
            self._handles.append(module.register_forward_pre_hook(self._pre_forward, with_kwargs=True, prepend=True))
            self._handles.append(module.register_forward_hook(self._post_forward, always_call=True))
        self._watched = [m for m in root.modules() if any(id(p) in self._unit_of for p in m.parameters(recurse=False))]
        watch(self._watched, self.on_read)

    def on_read(self, param: torch.nn.Parameter) -> None:
        """A forward reads `param` by name: if no running forward holds its unit, the innermost one takes it
        as an external parameter from now on, and it is gathered now ([Note: reads outside a module's own
        units] in `reads.py`)."""
        if not self.running:
            return
        unit = self._unit_of.get(id(param))
        if unit is None or unit.users > 0 or unit.persistent:
            return
        self.units_of[self.running[-1]].append(unit)
        self.trace.units_changed()
        if unit.master is None:
            self._holds_frozen.add(id(self.running[-1]))
        unit.users += 1
        unit.wait(approximate=True)

    def _fetch(self, event: tuple[str, int], units: list[ParamUnit]) -> None:
        self.trace.record(event, units)
        for unit in units:
            if unit.state is UnitState.SHARDED:
                gather_units(units, approximate=True)
                break
        self._prefetch()
        for unit in units:
            unit.wait(approximate=True)

    def _prefetch(self) -> None:
        """Keep the next `prefetch_numel` elements of upcoming units gathered or in flight. Units fetched
        ahead by earlier hooks count against it too: otherwise the window slides forward at every hook
        and the whole model ends up gathered."""
        now, released = self.trace.passes, self.live.released
        self.live.released = set()
        if self._all_ahead_fetched == now and not any(self.trace.needed_later(u) for u in released):
            # A scan in this pass found every unit to its end gathered, and no unit released since is needed
            # again in it: the window is a part of that one. (Without this, a budget above the model rescans
            # the rest of the pass at every hook: ~0.1 s per step for 110 units. Counting any release as a
            # reason to rescan, backward, which releases a unit at every hook, still spent ~25 ms per step.)
            return
        budget, counted, starting, live = self.prefetch_numel, set(), [], self.live.live
        for unit in self.trace.upcoming():  # never persistent units: they are always gathered
            if id(unit) in counted:
                continue
            counted.add(id(unit))
            if unit.numel > budget:
                break
            budget -= unit.numel
            if unit.state is UnitState.SHARDED:
                if live + unit.numel > self.max_live:
                    break
                live += unit.numel
                starting.append(unit)
        else:
            self._all_ahead_fetched = now
        if starting:
            gather_units(starting, approximate=True)  # together: small units share the collective's pieces

    def _pre_forward(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        if module is self.root:
            self.trace.start_pass(torch.is_grad_enabled())
            self.failure = None
        self.running.append(module)
        units = self.units_of[module]
        for unit in units:
            unit.users += 1
        self._fetch(("forward", id(module)), units)
        if id(module) not in self._holds_frozen or not torch.is_grad_enabled():
            return None  # what runs after this module's backward releases frozen units only (`post_backward`)
        flat = [(i, t) for i, t in enumerate(args) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not flat:
            return None
        wrapped = _AfterBackward.apply(self, module, *(t for _, t in flat))
        args = list(args)
        for (i, _), t in zip(flat, wrapped):
            args[i] = t
        return tuple(args), kwargs

    def _post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        error = sys.exc_info()[1]  # this hook runs even when the forward raised (always_call)
        if error is not None:
            self._note_failure(module, error)
        if self.running and self.running[-1] is module:
            self.running.pop()
        for unit in self.units_of[module]:
            unit.users -= 1
            if unit.users <= 0 and not self.in_backward and not self.trace.reused_within(unit, self.max_reuse):
                unit.release()
        if torch.is_grad_enabled():
            needs_grad = [t for t in _tensors(output) if t.requires_grad]
            if len(needs_grad) == 1:
                # One tensor's hook runs once per backward through it, as the multi-grad hook below would, for a
                # fifth of its cost (no lock, no table of graph tasks).
                needs_grad[0].register_hook(lambda _: self._pre_backward(module))
            elif needs_grad:
                torch.autograd.graph.register_multi_grad_hook(needs_grad, lambda _: self._pre_backward(module), mode="any")
        return None

    def _note_failure(self, module: torch.nn.Module, error: BaseException) -> None:
        """Before anything is released: which parameters the failing frames held while they were partitioned.
        The innermost failing module records it; the enclosing ones see the same error and keep that record."""
        if self.failure is not None and self.failure.error_id == id(error):
            return

        def partitioned(t: torch.Tensor) -> bool:
            unit = self._unit_of.get(id(t))
            return unit is not None and unit.state is not UnitState.FULL and any(p is t for p in unit.params)

        found = partitioned_in_frames(error.__traceback__, partitioned)
        names = [self._unit_of[id(t)].name_of(t) for t in found]
        self.failure = FailedForward(id(error), self._names.get(id(module), type(module).__name__), names)

    def _pre_backward(self, module: torch.nn.Module) -> None:
        self._bwd_users[id(module)] = self._bwd_users.get(id(module), 0) + 1
        self._fetch(("backward", id(module)), self.units_of[module])

    def post_backward(self, module: torch.nn.Module) -> None:
        left = self._bwd_users.get(id(module), 1) - 1
        self._bwd_users[id(module)] = left
        if left <= 0:
            for unit in self.units_of[module]:
                if unit.master is None:  # frozen: no gradient hook will release it
                    unit.release()

    def end_backward(self) -> None:
        self._bwd_users.clear()
        self.trace.commit()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        unwatch(self._watched)
