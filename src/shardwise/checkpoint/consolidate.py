"""Consolidate a checkpoint into full weights, streaming: peak memory is about two tensors (the one read
and the copy being written), not the model.

Writes the layout Hugging Face's `from_pretrained` reads: `model.safetensors`, or
`model-0000k-of-0000n.safetensors` files plus `model.safetensors.index.json` when the weights exceed
`max_shard_bytes`. Trainable parameters come from their fp32 masters, frozen ones from their stored
values. Shards are planned from the manifest (names, shapes) before any data is read, so each
output file is written tensor by tensor (`SafetensorsWriter`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import files, layout
from .errors import CheckpointError
from .reader import open_checkpoint
from .safetensors_file import SafetensorsWriter

if TYPE_CHECKING:
    from .reader import AnyReader

INDEX = "model.safetensors.index.json"
PICKLE_INDEX = "pytorch_model.bin.index.json"
Spec = tuple[str, torch.dtype, tuple[int, ...]]


def _specs(reader: AnyReader, dtype: torch.dtype, exclude_frozen: bool = False) -> list[Spec]:
    specs = [(name, dtype, tuple(entry["shape"])) for name, entry in reader.meta["params"].items()
             if entry["trainable"] or not exclude_frozen]
    for name in reader.meta.get("persistent_buffers", []):
        buf = reader.buffer(name)
        specs.append((name, buf.dtype, tuple(buf.shape)))
    return specs


def _plan(specs: list[Spec], max_shard_bytes: int) -> list[list[Spec]]:
    shards: list[list[Spec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = _nbytes(spec)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def _tensor(reader: AnyReader, name: str, dtype: torch.dtype) -> torch.Tensor:
    if name in reader.meta["params"]:
        kind = layout.MASTER if layout.MASTER in reader.kinds(name) else layout.VALUE
        return reader.read_full(name, kind, torch.float32).to(dtype)
    return reader.buffer(name)


def consolidate(checkpoint: str | Path, out_dir: str | Path, tag: str | None = None,
                max_shard_bytes: int = 5 * 2**30, dtype: torch.dtype = torch.float32,
                exclude_frozen: bool = False, pickle_format: bool = False) -> list[Path]:
    """Write the full weights of `checkpoint` to `out_dir`; returns the files written.

    `pickle_format` writes `pytorch_model*.bin` files with `torch.save` instead of safetensors, for
    DeepSpeed's `convert_zero_checkpoint_to_fp32_state_dict(safe_serialization=False)`: each such file is
    built whole in memory (torch.save cannot stream), so its peak is one shard rather than one tensor."""
    reader = open_checkpoint(checkpoint, tag)
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(files.write_error(out, e)) from e
    shards = _plan(_specs(reader, dtype, exclude_frozen), max_shard_bytes)
    stem, suffix, index = ("pytorch_model", ".bin", PICKLE_INDEX) if pickle_format else ("model", ".safetensors", INDEX)
    if len(shards) == 1:
        names = [stem + suffix]
    else:
        names = [f"{stem}-{i + 1:05d}-of-{len(shards):05d}{suffix}" for i in range(len(shards))]
    written: list[Path] = []
    try:
        for specs, name in zip(shards, names):
            _write_shard(reader, out / name, specs, pickle_format)
            written.append(out / name)
        if len(shards) > 1:
            total = sum((out / n).stat().st_size for n in names)
            weight_map = {spec[0]: name for specs, name in zip(shards, names) for spec in specs}
            files.write_durably(out / index, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                        indent=1).encode())
    except CheckpointError as e:
        # Shards without the rest of the set (or without their index) are not a model: none is left behind.
        for path in written:
            files.remove_quietly(path)
        removed = (f" ({', '.join(p.name for p in written)}, already written, {'was' if len(written) == 1 else 'were'} "
                   "removed)") if written else ""
        raise CheckpointError(f"{e} No file of this conversion was left in {out}{removed}.") from e
    return written


def _write_shard(reader: AnyReader, path: Path, specs: list[Spec], pickle_format: bool) -> None:
    """Write one output file through a temporary name, removed on failure; a failed write (a full disk) is
    a CheckpointError naming `path`."""
    tmp = path.with_name(f".{path.name}.partial")
    writer = None
    try:
        if pickle_format:
            with open(tmp, "wb") as f:  # through a file object: torch.save to a path loses the errno (ENOSPC)
                torch.save({n: _tensor(reader, n, d) for n, d, _ in specs}, f)
                f.flush()
                os.fsync(f.fileno())
        else:
            writer = SafetensorsWriter(tmp, specs, metadata={"format": "pt"})
            for tensor_name, tensor_dtype, _ in specs:
                writer.write(tensor_name, _tensor(reader, tensor_name, tensor_dtype))
            writer.close()
        os.replace(tmp, path)
    except BaseException as e:
        if writer is not None:
            writer.abort()  # a no-op once closed
        files.remove_quietly(tmp)
        if isinstance(e, OSError):
            raise CheckpointError(files.write_error(path, e, sum(_nbytes(spec) for spec in specs))) from e
        raise


def _nbytes(spec: Spec) -> int:
    numel = 1
    for d in spec[2]:
        numel *= d
    return numel * torch.empty((), dtype=spec[1]).element_size()
