"""Say so when another DeepSpeed could be shadowed by this compatibility package (or shadow it)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
import warnings

_HERE = os.path.dirname(os.path.abspath(__file__))


def _other_deepspeed_dirs() -> list[str]:
    """Directories on sys.path holding a `deepspeed` package that is not this one."""
    found = []
    for entry in sys.path:
        candidate = os.path.join(entry or os.getcwd(), "deepspeed")
        if os.path.isfile(os.path.join(candidate, "__init__.py")) and os.path.realpath(candidate) != os.path.realpath(_HERE):
            found.append(candidate)
    return found


def warn_if_shadowing() -> None:
    others = _other_deepspeed_dirs()
    try:
        version = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if others or (version is not None and not version.endswith("+shardwise")):
        where = ", ".join(others) or f"distribution metadata deepspeed {version}"
        warnings.warn(
            f"`import deepspeed` loaded shardwise's compatibility package ({_HERE}), but another DeepSpeed is "
            f"installed too ({where}). Which one a script gets depends on sys.path order. Keep one: "
            "`pip uninstall deepspeed` and reinstall the one you want (`pip install ./compat/deepspeed` for "
            "shardwise, `pip install deepspeed` for DeepSpeed).", stacklevel=3)
