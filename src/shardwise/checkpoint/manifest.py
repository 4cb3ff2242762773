"""Read and check a checkpoint's manifest before anything is loaded from it.

Every field the loader and the consolidation tool use is checked here, once, so that a manifest that is
foreign, hand-edited, from another format version or corrupt is refused with the manifest's path and what
is wrong, instead of surfacing later as a KeyError or as a silently short parameter.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import layout
from .deepspeed_layout import deepspeed_checkpoint_message
from .errors import CheckpointError

# key -> the JSON type it must have (None allowed where the saver writes None)
_REQUIRED: dict[str, tuple[type, ...]] = {
    "world_size": (int,), "files": (dict,), "params": (dict,), "counters": (dict,), "buffers": (list,),
    "persistent_buffers": (list,), "optimizer": (dict,), "loss_scaler": (dict,), "client_state": (object,),
    "lr_scheduler": (dict, type(None)),
}
MAX_LISTED = 10


def read_manifest(path: Path) -> dict[str, Any]:
    """The checked manifest of the tag directory `path`."""
    manifest = path / layout.MANIFEST
    if not manifest.is_file():
        raise CheckpointError(deepspeed_checkpoint_message(path)
                              or f"{manifest}: missing; {path} is not a complete shardwise checkpoint.")
    try:
        meta = json.loads(manifest.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{manifest}: not valid JSON ({e}); the manifest is corrupt or not a shardwise "
                              "manifest.") from None
    except OSError as e:
        raise CheckpointError(f"{manifest}: cannot be read ({e.strerror}).") from None
    if not isinstance(meta, dict) or "format_version" not in meta:
        raise CheckpointError(f"{manifest}: has no format_version; it is not a shardwise checkpoint manifest.")
    if meta["format_version"] != layout.FORMAT_VERSION:
        raise CheckpointError(f"{manifest}: format_version {meta['format_version']!r}, this shardwise reads "
                              f"{layout.FORMAT_VERSION}; it was written by an incompatible shardwise version.")
    problems = _problems(meta)
    if problems:
        listed = "; ".join(problems[:MAX_LISTED]) + (f"; and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else "")
        raise CheckpointError(f"{manifest}: inconsistent ({listed}); the manifest is corrupt or was edited.")
    return meta


def _problems(meta: dict[str, Any]) -> list[str]:
    problems = [f"{key!r} missing or not {' or '.join(t.__name__ for t in types)}"
                for key, types in _REQUIRED.items() if key not in meta or not isinstance(meta[key], types)]
    if problems:
        return problems
    optimizer = meta["optimizer"]
    foreign = meta.get("origin") == "deepspeed" and optimizer.get("type") is None  # imported: DeepSpeed's optimizer
    if not ((isinstance(optimizer.get("type"), str) or foreign) and isinstance(optimizer.get("param_groups"), list)
            and isinstance(optimizer.get("scalars"), dict)):
        problems.append("'optimizer' has no type, param_groups and scalars")
    for name, entry in meta["files"].items():
        if not (isinstance(entry, dict) and _is_count(entry.get("bytes"))
                and isinstance(entry.get("crc32", entry.get("sha256")), str)):
            problems.append(f"file {name!r} has no byte count and checksum")
    for name, entry in meta["params"].items():
        problems += _param_problems(name, entry, meta["files"])
    return problems


def _param_problems(name: str, entry: Any, files: dict[str, Any]) -> list[str]:
    if not isinstance(entry, dict) or not isinstance(entry.get("pieces"), list):
        return [f"parameter {name!r} has no pieces"]
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        return [f"parameter {name!r} has shape {shape!r}, not a list of sizes"]
    split = entry.get("tp")
    if split is not None:
        problem = _split_problem(name, shape, split)
        if problem:
            return [problem]
    numel = numel_of(shape) // (split["parts"] if split else 1)  # a piece counts elements of its part
    problems = []
    for piece in entry["pieces"]:
        if not isinstance(piece, dict) or piece.get("file") not in files or not isinstance(piece.get("kinds"), list):
            problems.append(f"parameter {name!r} has a piece in no listed file: {piece!r}")
        elif not (_is_count(piece.get("start")) and _is_count(piece.get("end"))
                  and piece["start"] <= piece["end"] <= numel):
            problems.append(f"parameter {name!r} (shape {tuple(shape)}, {numel} elements) has a piece "
                            f"[{piece.get('start')!r}, {piece.get('end')!r}) outside it")
        elif split is not None and not (_is_count(piece.get("part")) and piece["part"] < split["parts"]):
            problems.append(f"parameter {name!r} is split in {split['parts']} tensor-parallel parts but has a piece of "
                            f"part {piece.get('part')!r}")
        elif split is None and "part" in piece:
            problems.append(f"parameter {name!r} is not split but has a piece of tensor-parallel part {piece['part']!r}")
    if not problems and not layout.covered_parts(entry):
        problems.append(f"the pieces of parameter {name!r} do not cover its shape {tuple(shape)}")
    return problems


def _split_problem(name: str, shape: list[int], split: Any) -> str | None:
    """A tensor-parallel split that does not describe equal parts of `shape`, or None."""
    if not (isinstance(split, dict) and all(_is_count(split.get(k)) for k in ("dim", "parts", "blocks"))):
        return f"parameter {name!r} has a tensor-parallel split {split!r} without dim, parts and blocks"
    if not (split["dim"] < len(shape) and split["parts"] > 0 and split["blocks"] > 0
            and shape[split["dim"]] % (split["parts"] * split["blocks"]) == 0):
        return f"parameter {name!r} (shape {tuple(shape)}) cannot be split as {split}"
    return None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def numel_of(shape: list[int] | tuple[int, ...]) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel
