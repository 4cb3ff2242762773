"""Durable file writes and the per-rank RNG state, shared by saving and loading."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from .errors import CheckpointError


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes) -> None:
    """Write to a temporary name, fsync, rename: readers see the old file or the new one, never half.
    A failure is a CheckpointError naming `path` (the temporary file is removed)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(write_error(path, e, len(data))) from e


def write_tag_folder(root: Path, tag: str, write: Callable[[Path], None], what: str, latest: bool = True,
                     replaceable: Callable[[Path], bool] | None = None) -> Path:
    """Write `root/<tag>/` whole or not at all: `write` fills `.<tag>.partial/`, which is fsynced and renamed into
    place, then `root/latest` names it (unless not `latest`). An existing `root/<tag>` is an error unless
    `replaceable(it)`, and then goes only once the new one is in place. Any failure removes the partial folder;
    an OSError becomes a CheckpointError naming the file. `what` names the operation in messages."""
    final, partial = root / tag, root / f".{tag}.partial"
    if final.exists() and not (replaceable is not None and replaceable(final)):
        raise CheckpointError(f"{what}: {final} exists; {what} to another folder or tag, or remove it first.")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        partial.mkdir(parents=True)
        write(partial)
        fsync_dir(partial)
        if final.exists():
            old = final.with_name(f".{final.name}.replaced")
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            partial.rename(final)
            shutil.rmtree(old)
        else:
            partial.rename(final)
        fsync_dir(root)
        if latest:
            write_durably(root / "latest", tag.encode())
    except OSError as e:
        shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointError(write_error(Path(e.filename or partial), e)) from e
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return final


def remove_quietly(path: Path) -> None:
    """Remove a temporary file after a failed write; a failure to remove it must not hide the write's error."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def write_error(path: Path, error: BaseException, needed: int | None = None) -> str:
    """What went wrong writing `path`, naming it: a full disk says how many bytes were needed and are free.
    (OSError from a write carries no file name, and safetensors' own error carries neither name nor errno.)"""
    if getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "os error 28" in str(error) \
            or "No space left on device" in str(error):
        free = shutil.disk_usage(_existing(path)).free
        wanted = f"about {needed} bytes for this file, " if needed is not None else ""
        return (f"{path}: no space left on device ({wanted}{free} bytes free on that filesystem now); free "
                "space or save elsewhere.")
    return f"{path}: cannot be written ({getattr(error, 'strerror', None) or error})."


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def rng_state() -> tuple[dict[str, torch.Tensor], str]:
    """(tensors, JSON) of this process's RNG states: python, numpy, torch, and the device's."""
    tensors = {"rng|torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["rng|cuda"] = torch.cuda.get_rng_state()
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return tensors, json.dumps({"python": [version, list(internal), gauss],
                                "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]})


def set_rng_state(tensors: dict[str, torch.Tensor], text: str) -> None:
    state: dict[str, Any] = json.loads(text)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["rng|torch"])
    if "rng|cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng|cuda"])
