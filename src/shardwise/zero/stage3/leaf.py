"""ZeRO-3 leaf modules (DeepSpeed's `deepspeed.utils.set_z3_leaf_modules` and friends).

A leaf module is gathered whole: every parameter of its subtree is gathered when its forward (or backward)
starts, and its descendants get no hooks of their own. Use it where the order in which submodules run changes
from step to step (a mixture-of-experts block routes tokens to different experts; the recorded order would
not prefetch the right ones, and ranks could run different experts) or where a module's forward reads its
children's parameters without calling them. Mark modules before `shardwise.initialize`: the engine reads the
marks once, when it builds its hooks.

The mark is the module attribute `_z3_leaf`, as DeepSpeed keeps it, so a copy of the model keeps it too.

[Note: leaves by granularity] `zero_optimization.stage3_module_granularity_threshold` (DeepSpeed's key, 0: off)
marks leaves by size instead of by class. A module's granularity is the elements of its subtree per "layer",
where the layers are the subtree's parameter-holding modules without children plus the module itself;
modules without children, modules holding no parameter, torch's containers (ModuleList, Sequential, ...: their
children's hooks must stay) and subtrees above `MAX_LEAF_ELEMENTS` are never leaves. Walking from the root, the
first module at or below the threshold on each path becomes a leaf, so a transformer block is chosen before its
attention and MLP. Every module keeps its own unit (its gather and gradient reduction); what goes is the hooks of
the leaf's descendants, each a forward pre/post hook, a backward hook and a wait per module per step. On the
33.7M-parameter bench GPT at world 2 (CPU), marking its 27 blocks (by class, `set_z3_leaf_modules`) leaves 32
hooked modules instead of 167 (every module holding a unit: 110 linear layers, the layer norms, the root), and
the ZeRO-3 step ran 2-3.5 % faster (benchmarks/zero3_leaves.py, paired steps in the same processes: medians
0.969, 0.979 and, in an earlier harness, 0.964). By granularity that GPT cannot get there: its root, whose
subtree holds the 16M-element embedding, has the smallest granularity of all, so a threshold either marks
nothing or the whole model (gathered whole for every forward), as DeepSpeed's does with the same key.
"""

from __future__ import annotations

import sys
from typing import Sequence

import torch

from ...profiling.memory import whole_numel

MAX_LEAF_ELEMENTS = 10**9
"""A subtree larger than this is never made a leaf by granularity: it would be gathered whole at once."""


def z3_leaf_module(module: torch.nn.Module) -> bool:
    """Whether `module` is marked as a ZeRO-3 leaf."""
    return bool(getattr(module, "_z3_leaf", False))


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of `model` marked as leaves, in `model.modules()` order."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def outermost_leaves(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The leaves of `model` not inside another leaf, in `model.modules()` order: each is gathered with its whole
    subtree, so a leaf below it changes nothing."""
    leaves: list[torch.nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) not in inside and z3_leaf_module(module):
            leaves.append(module)
            inside.update(id(m) for m in module.modules())
    return leaves


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


def granularities(model: torch.nn.Module) -> dict[int, int]:
    """id(module) -> elements per layer, for the modules that may become leaves ([Note: leaves by granularity])."""
    found: dict[int, int] = {}
    containers = {getattr(torch.nn, name) for name in torch.nn.modules.container.__all__}

    def visit(module: torch.nn.Module) -> tuple[int, int]:  # (layers, elements) of the subtree
        elements = sum(whole_numel(p) for p in module.parameters(recurse=False))  # whole, also after zero.Init
        children = list(module.children())
        if not children:
            return (1, elements) if elements else (0, 0)
        layers = 0
        for child in children:
            child_layers, child_elements = visit(child)
            layers, elements = layers + child_layers, elements + child_elements
        if elements == 0 or type(module) in containers:
            return layers, elements
        layers += 1
        if elements <= MAX_LEAF_ELEMENTS:
            found[id(module)] = elements // layers
        return layers, elements

    visit(model)
    return found


def set_leaves_by_granularity(model: torch.nn.Module, threshold: int) -> tuple[list[torch.nn.Module], int]:
    """Mark the outermost modules whose granularity is at most `threshold` as leaves; returns them and the smallest
    granularity in the model (sys.maxsize if none), which a threshold below it leaves without effect."""
    sizes = granularities(model)
    marked: list[torch.nn.Module] = []

    def visit(module: torch.nn.Module) -> None:
        if sizes.get(id(module), sys.maxsize) <= threshold:
            module._z3_leaf = True
            marked.append(module)
            return
        for child in module.children():
            visit(child)

    visit(model)
    return marked, min(sizes.values(), default=sys.maxsize)
