"""Check `optimizer.params` / `scheduler.params` against the class's typed arguments before it is built.

A config value of the wrong type otherwise fails deep inside torch ("unsupported operand type(s) for -:
'str' and 'float'") or, worse, at the first step ("too many values to unpack" for three Adam betas).
The expected type comes from the class's annotations (torch's optimizers are annotated), else from the
argument's default value.
"""

from __future__ import annotations

import inspect
import types
import typing
from typing import Any

import torch

_NUMBER = "a number"


def argument_problems(where: str, cls: type, params: dict[str, Any]) -> list[str]:
    """One message per argument in `params` whose value does not fit the type `cls.__init__` declares."""
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # noqa: BLE001 - unresolvable annotations: fall back to the defaults' types
        hints = {}
    signature = inspect.signature(cls.__init__)
    problems = []
    for key, value in params.items():
        arg = signature.parameters.get(key)
        if arg is None:
            continue  # unknown names are reported by the caller, with "did you mean"
        expected = hints.get(key, _type_of_default(arg.default))
        required = _requirement(expected, value)
        if required is not None:
            problems.append(f"{where}.{key}: needs {required}; got {value!r}{_kind(value)}. {_fix(value, required)}")
    return problems


def _type_of_default(default: Any) -> Any:
    if default is inspect.Parameter.empty or default is None:
        return Any
    if isinstance(default, tuple):
        return tuple[tuple(type(d) for d in default)]  # type: ignore[misc]
    return type(default)


def _requirement(expected: Any, value: Any) -> str | None:
    """None if `value` fits `expected`, else what is required, in words."""
    if expected is Any or expected is object:
        return None
    origin = typing.get_origin(expected)
    if origin in (typing.Union, types.UnionType):
        arms = typing.get_args(expected)
        needs = [_requirement(arm, value) for arm in arms]
        if any(n is None for n in needs):
            return None
        words = [n for n in dict.fromkeys(needs) if n and n != "null"]  # null is the default, not advice
        return " or ".join(words or ["null"])
    if expected is type(None):
        return None if value is None else "null"
    if expected is bool:
        return None if isinstance(value, bool) else "true or false"
    if expected in (int, float, torch.Tensor):
        return None if _is_number(value) else _NUMBER
    if expected is str:
        return None if isinstance(value, str) else "a string"
    if origin is tuple:
        return _sequence_requirement(typing.get_args(expected), value)
    if origin is list:
        items = typing.get_args(expected)
        required = f"a list of {_plural(_requirement(items[0], object()))}" if items else "a list"
        if not isinstance(value, (list, tuple)):
            return required
        return None if all(not items or _requirement(items[0], v) is None for v in value) else required
    return None  # a type this check does not know: the class checks it


def _sequence_requirement(items: tuple[Any, ...], value: Any) -> str | None:
    if items and items[-1] is Ellipsis:
        return None
    words = {1: "one", 2: "two", 3: "three"}.get(len(items), str(len(items)))
    required = f"{words} {_plural(_requirement(items[0], object()) or _NUMBER)}"
    if all(i in (int, float, torch.Tensor) or _requirement(i, 0.5) is None for i in items):
        required += ", e.g. [0.9, 0.999]" if len(items) == 2 else ""
    if not isinstance(value, (list, tuple)) or len(value) != len(items):
        return required
    return None if all(_requirement(i, v) is None for i, v in zip(items, value)) else required


def _plural(requirement: str | None) -> str:
    return {"a number": "numbers", "a string": "strings", "true or false": "booleans"}.get(requirement or "", "values")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    if isinstance(value, str):
        return " (a string)"
    if isinstance(value, bool):
        return " (a boolean)"
    if isinstance(value, (list, tuple)):
        return f" ({len(value)} value{'s' if len(value) != 1 else ''})"
    return ""


def _fix(value: Any, required: str) -> str:
    if isinstance(value, str) and required.startswith(_NUMBER):
        try:
            float(value)
            return f"Write it without quotes: {value}."
        except ValueError:
            pass
    return "Correct the value or remove the key to use the default."
