"""Open one of DeepSpeed's checkpoint files without running anything it holds.

DeepSpeed's files are pickles (`torch.save`), and unpickling a file can call any function it names: a
checkpoint downloaded or shared is code. They are read here with torch's weights-only unpickler, which builds
only tensors, containers and plain values, plus an allowlist of the few DeepSpeed objects the files hold,
each mapped to an inert stand-in that keeps the attributes and can do nothing else. DeepSpeed is never
imported and no `__reduce__` is ever run; any other global a file names is refused with the file's name and
the global's. Files are memory-mapped, so a rank reads the pages of the slices it loads, not whole files; the
price is that a file rewritten in place while a load reads it (DeepSpeed saving the same tag again) ends the
reading process with SIGBUS, so load a tag no run is writing.
"""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError


class DeepSpeedObject:
    """An inert stand-in for one of DeepSpeed's pickled objects: its constructor arguments (`args`, an enum's
    value, a namedtuple's fields) and its attributes, nothing callable."""

    def __new__(cls, *args: Any) -> DeepSpeedObject:
        obj = super().__new__(cls)
        obj.args = args
        return obj

    def __init__(self, *args: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (__dict__, __slots__ state), as pickle allows
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update({str(k): v for k, v in state.items()})


class LossScalerState(DeepSpeedObject):
    """deepspeed.runtime.fp16.loss_scaler.LossScaler / DynamicLossScaler: cur_scale, cur_iter, ..."""


class ZeroStage(DeepSpeedObject):
    """deepspeed.runtime.zero.config.ZeroStageEnum: args[0] is the stage."""


class FragmentAddress(DeepSpeedObject):
    """deepspeed.utils.tensor_fragment.fragment_address: args are (numel, start)."""


class Namespace(DeepSpeedObject):
    """argparse.Namespace, which Megatron-DeepSpeed scripts keep in their client state as `args`."""


# DeepSpeed 0.19.8 writes these (and only these) non-torch globals in its ZeRO checkpoints (found by listing the
# GLOBAL opcodes of every file it wrote for the tests); argparse.Namespace is Megatron-DeepSpeed's client state.
ALLOWED: dict[str, type[DeepSpeedObject]] = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": LossScalerState,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": LossScalerState,
    "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStage,
    "deepspeed.utils.tensor_fragment.fragment_address": FragmentAddress,
    "argparse.Namespace": Namespace,
}

_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def load_deepspeed_file(path: Path) -> dict[str, Any]:
    """The dict a DeepSpeed checkpoint file holds, tensors memory-mapped where the file allows it."""
    data = load_deepspeed_object(path)
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: holds a {type(data).__name__}, not the dict DeepSpeed saves; it is not a "
                              "DeepSpeed checkpoint file.")
    return data


def load_deepspeed_object(path: Path) -> Any:
    """Whatever a DeepSpeed checkpoint file holds (a universal checkpoint's step.pt is a bare int), read safely."""
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; the DeepSpeed checkpoint is incomplete.")
    mmap = zipfile.is_zipfile(path)  # torch.save's format since torch 1.6; older files are read whole
    try:
        with torch.serialization.safe_globals([(cls, name) for name, cls in ALLOWED.items()]):
            data = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        found = _GLOBAL.search(str(e))
        what = f"names {found.group(1)!r}" if found else f"holds something other than tensors and data ({e})"
        raise CheckpointError(
            f"{path}: refused: the file {what}, which is not among the DeepSpeed objects a checkpoint holds "
            f"({', '.join(sorted(ALLOWED))}). Unpickling it could run code, so nothing in it was run. If you wrote "
            "this file yourself and trust it, load it with torch.load(weights_only=False) and save the weights "
            "again.") from None
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as e:
        raise CheckpointError(f"{path}: not a readable torch.save file ({type(e).__name__}: {e}); it is truncated "
                              "or corrupt, or not a DeepSpeed checkpoint file.") from None
    return data


# -- writing: DeepSpeed's own objects, named in the pickle without importing DeepSpeed ---------------------------

class DeepSpeedClass:
    """A DeepSpeed class as a pickle names it (module, name); only written, never looked up here."""

    def __init__(self, qualified: str) -> None:
        self.module, _, self.name = qualified.rpartition(".")

    def __call__(self, *args: Any) -> None:  # pickle writes only callables as a reduce's function
        raise TypeError(f"{self.module}.{self.name} is DeepSpeed's; shardwise only names it in a file it writes.")


class DeepSpeedInstance:
    """An object of `cls` for DeepSpeed to rebuild: `cls(*args)`, then its attributes set to `state`."""

    def __init__(self, cls: str, args: tuple[Any, ...] = (), state: dict[str, Any] | None = None) -> None:
        self.cls, self.args, self.state = DeepSpeedClass(cls), args, state


class _Pickler(pickle._Pickler):  # the pure-Python pickler: its save_global can be told about DeepSpeedClass
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, DeepSpeedClass):
            return obj.name  # a global: written by save_global below
        if isinstance(obj, DeepSpeedInstance):
            return (obj.cls, obj.args) if obj.state is None else (obj.cls, obj.args, obj.state)
        return NotImplemented

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if not isinstance(obj, DeepSpeedClass):
            super().save_global(obj, name)
            return
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode("utf-8"))  # protocol 2, as DeepSpeed writes
        self.memoize(obj)


class _PickleModule:
    Pickler = _Pickler


def save_deepspeed_file(data: dict[str, Any], path: Path) -> None:
    """`torch.save` `data` to `path`, each DeepSpeedInstance in it pickled as the DeepSpeed object it stands for."""
    with open(path, "wb") as f:
        torch.save(data, f, pickle_module=_PickleModule)  # type: ignore[arg-type]
        f.flush()
        os.fsync(f.fileno())
