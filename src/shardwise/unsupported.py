"""Stand-ins for DeepSpeed features shardwise does not have yet (MoE layers, pipeline modules, the inference
engine, ...): importing them works, as scripts import them at the top; using one raises an error that names
the feature and what to do instead, rather than failing later with an unrelated message."""

from __future__ import annotations

from typing import Any, Callable, NoReturn


class NotSupportedError(NotImplementedError):
    """A DeepSpeed feature that shardwise does not implement (yet)."""


def _refuse(name: str, instead: str) -> NoReturn:
    raise NotSupportedError(f"{name}: not supported by shardwise yet; {instead}")


def unsupported_class(name: str, instead: str) -> type:
    """A class that can be imported and subclassed but refuses to be built."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        _refuse(name, instead)

    return type(name.rsplit(".", 1)[-1], (), {"__init__": __init__, "__doc__": f"Not supported: {instead}"})


def unsupported_function(name: str, instead: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        _refuse(name, instead)

    refuse.__name__ = name.rsplit(".", 1)[-1]
    refuse.__doc__ = f"Not supported: {instead}"
    return refuse
