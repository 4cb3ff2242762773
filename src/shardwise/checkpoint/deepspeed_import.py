"""`shardwise checkpoint import`: a converted copy of a DeepSpeed checkpoint, in shardwise's format.

`load_checkpoint` reads DeepSpeed's folders directly, so converting is never needed to resume; this is for those
who want a copy on disk: safetensors (no pickle), CRC32-checked, readable without the DeepSpeed files. The copy is
one `rank0.safetensors` holding every parameter whole, written one tensor at a time from DeepSpeed's
memory-mapped partitions, with a manifest marked `"origin": "deepspeed"` (so the loader applies the same rules as
to the folder itself: DeepSpeed's optimizer groups, no RNG state).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from ..version import __version__
from . import files, layout
from .errors import CheckpointError
from .reader import open_checkpoint
from .safetensors_file import SafetensorsWriter
from .tags import load_tag_problem

def import_deepspeed(source: str | Path, out_dir: str | Path, source_tag: str | None = None,
                     tag: str | None = None) -> Path:
    """Write the DeepSpeed checkpoint `source` (its `latest`, or `source_tag`) to `out_dir/<tag>` in shardwise's
    format and point `out_dir/latest` at it; returns the tag folder."""
    reader = open_checkpoint(source, source_tag)
    if getattr(reader, "origin", None) != "deepspeed":
        raise CheckpointError(f"import: {reader.path} is already a shardwise checkpoint; nothing to convert.")
    meta = reader.meta
    tag = tag or reader.path.name
    problem = load_tag_problem(tag)
    if problem:
        raise CheckpointError(f"import: tag {problem}; got {tag!r}.")
    try:
        json.dumps(meta["client_state"])
    except TypeError as e:
        raise CheckpointError(f"import: {reader.path}: the client state is not JSON ({e}); shardwise's format keeps "
                              "client_state as JSON. Load the DeepSpeed folder directly instead.") from None

    def write(folder: Path) -> None:
        params, specs = _index(reader)
        file = folder / layout.rank_file(0)
        writer = SafetensorsWriter(file, specs)
        try:
            for key, dtype, _ in specs:
                writer.write(key, _tensor(reader, key, dtype))
            writer.close()
        except BaseException:
            writer.abort()
            raise
        manifest = {
            **{k: meta[k] for k in ("origin", "stage", "config", "counters", "data_loader", "loss_scaler",
                                    "lr_scheduler", "client_state", "optimizer", "frozen_parameters_excluded",
                                    "shared_params")},
            "format_version": layout.FORMAT_VERSION, "shardwise_version": __version__, "tag": tag,
            "deepspeed_version": meta.get("deepspeed_version"), "world_size": 1, "topology": {"data": 1},
            "files": {file.name: {"bytes": file.stat().st_size, "crc32": layout.crc32_of(file)}},
            "params": params, "buffers": list(meta["buffers"]), "persistent_buffers": list(meta["persistent_buffers"]),
            "buffer_files": {name: file.name for name in meta["buffers"]},
        }
        files.write_durably(folder / layout.MANIFEST, json.dumps(manifest, indent=1).encode())

    return files.write_tag_folder(Path(out_dir), tag, write, "import")


def _index(reader: Any) -> tuple[dict[str, Any], list[tuple[str, torch.dtype, tuple[int, ...]]]]:
    """The manifest's parameter entries (each whole, in rank 0's file) and the file's tensors, in order."""
    params, specs = {}, []
    for name, entry in reader.meta["params"].items():
        numel = math.prod(entry["shape"])
        kinds = sorted(reader.kinds(name))
        stored = reader.stored_dtype(name) if not entry["trainable"] else torch.float32
        params[name] = {"shape": entry["shape"], "dtype": str(stored).removeprefix("torch."),
                        "trainable": entry["trainable"],
                        "pieces": [{"file": layout.rank_file(0), "start": 0, "end": numel, "kinds": kinds}]}
        specs += [(layout.piece_key(name, kind, 0), torch.float32 if kind != layout.VALUE else stored, (numel,))
                  for kind in kinds]
    for name in reader.meta["buffers"]:
        buf = reader.buffer(name)
        specs.append((layout.buffer_key(name), buf.dtype, tuple(buf.shape)))
    return params, specs


def _tensor(reader: Any, key: str, dtype: torch.dtype) -> torch.Tensor:
    if key.startswith("buffer|"):
        return reader.buffer(key.removeprefix("buffer|"))
    name, kind, _ = key.rsplit("|", 2)
    return reader.read_full(name, kind, dtype).reshape(-1)
