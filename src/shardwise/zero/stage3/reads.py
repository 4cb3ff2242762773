"""Parameters a forward reads without holding them: found at the read, or named when the forward fails.

[Note: reads outside a module's own units] A module's hooks gather the units of its own parameters, but some
forwards read other modules' parameters: `nn.MultiheadAttention` hands `self.out_proj.weight` to a function
without calling `out_proj`; a model's head may read the embedding's weight. As DeepSpeed does, each module's
`_parameters` dict is replaced by `WatchedParameters`, whose item lookup (what `module.weight` runs) reports
the read to the hooks while a forward runs. A parameter whose unit no running forward holds is then
registered with the innermost running module, exactly as `register_external_parameter` would have done (from
then on that module gathers it at its forward and its backward), and gathered at once. Every rank runs the
same code, so every rank registers and gathers in the same order.

A read that does not go through a module attribute (a parameter kept in a plain list, a closure,
`named_parameters()`) is not seen and gets the empty placeholder. When a forward fails, the hooks record which
parameters the failing frames held while they were partitioned (`partitioned_in_frames`), so the error can
say so instead of leaving a bare "mat2 must be a matrix".
"""

from __future__ import annotations

import weakref
from types import TracebackType
from typing import Any, Callable, Iterator

import torch


class WatchedParameters(dict):
    """A module's `_parameters`, reporting every lookup by name to `on_read` (held weakly)."""

    __slots__ = ("_on_read",)

    def __init__(self, params: dict[str, Any], on_read: weakref.WeakMethod):
        super().__init__(params)
        self._on_read = on_read

    def __getitem__(self, name: str) -> Any:
        param = dict.__getitem__(self, name)
        on_read = self._on_read()
        if on_read is not None and param is not None:
            on_read(param)
        return param

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (dict(self),))  # a copy (pickle, deepcopy) belongs to no engine: a plain dict


def watch(modules: list[torch.nn.Module], on_read: Callable[[torch.nn.Parameter], None]) -> None:
    reporter = weakref.WeakMethod(on_read)  # type: ignore[arg-type]
    for module in modules:
        module._parameters = WatchedParameters(module._parameters, reporter)


def unwatch(modules: list[torch.nn.Module]) -> None:
    for module in modules:
        if isinstance(module._parameters, WatchedParameters):
            module._parameters = dict(module._parameters)


def _tensors_in(value: Any) -> Iterator[Any]:
    yield value
    if isinstance(value, (list, tuple)):
        yield from value
    elif isinstance(value, dict):
        yield from value.values()


def partitioned_in_frames(tb: TracebackType | None, partitioned: Callable[[torch.Tensor], bool]) -> list[torch.Tensor]:
    """The tensors for which `partitioned` holds among the local variables (and the items of list, tuple and
    dict locals) of every frame of `tb`, each once."""
    found: list[torch.Tensor] = []
    while tb is not None:
        for value in list(tb.tb_frame.f_locals.values()):
            for item in _tensors_in(value):
                if isinstance(item, torch.Tensor) and partitioned(item) and all(item is not f for f in found):
                    found.append(item)
        tb = tb.tb_next
    return found
