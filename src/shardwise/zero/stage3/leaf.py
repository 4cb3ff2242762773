"""ZeRO-3 leaf modules (DeepSpeed's `deepspeed.utils.set_z3_leaf_modules` and friends).

A leaf module is gathered whole: every parameter of its subtree is gathered when its forward (or backward)
starts, and its descendants get no hooks of their own. Use it where the order in which submodules run changes
from step to step (a mixture-of-experts block routes tokens to different experts; the recorded order would
not prefetch the right ones, and ranks could run different experts) or where a module's forward reads its
children's parameters without calling them. Mark modules before `shardwise.initialize`: the engine reads the
marks once, when it builds its hooks.

The mark is the module attribute `_z3_leaf`, as DeepSpeed keeps it, so a copy of the model keeps it too.
"""

from __future__ import annotations

from typing import Sequence

import torch


def z3_leaf_module(module: torch.nn.Module) -> bool:
    """Whether `module` is marked as a ZeRO-3 leaf."""
    return bool(getattr(module, "_z3_leaf", False))


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of `model` marked as leaves, in `model.modules()` order."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def _matches(module: torch.nn.Module, wanted: type | str) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    cls = type(module)
    return wanted in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _mark(model: torch.nn.Module, classes: Sequence[type | str], flag: bool, raise_if_not_found: bool) -> list[torch.nn.Module]:
    bad = [c for c in classes if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(f"leaf_module_classes: must be module classes or class names; got {bad!r}. "
                        "Pass e.g. [MixtralSparseMoeBlock] or ['MixtralSparseMoeBlock'].")
    marked = []
    for module in model.modules():
        if any(_matches(module, c) for c in classes):
            module._z3_leaf = flag
            marked.append(module)
    if not marked and raise_if_not_found:
        raise ValueError(f"leaf_module_classes: no module of {list(classes)!r} in the model "
                         f"({type(model).__name__}); check the class names, or pass raise_if_not_found=False.")
    return marked


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: Sequence[type | str],
                        raise_if_not_found: bool = True) -> list[torch.nn.Module]:
    """Mark every module of `model` that is an instance of one of `leaf_module_classes` (classes, class names
    or fully qualified names) as a ZeRO-3 leaf; returns the marked modules."""
    return _mark(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: Sequence[type | str],
                          raise_if_not_found: bool = True) -> list[torch.nn.Module]:
    """Remove the leaf mark from the matching modules; returns them."""
    return _mark(model, leaf_module_classes, False, raise_if_not_found)
