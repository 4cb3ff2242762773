"""Read slices of a safetensors file with plain reads (pread), never mapping the file.

safetensors' own `safe_open` maps the whole file; every page it touches then counts towards the
process's resident memory until the file is closed, so streaming a large checkpoint through it
would look (and, under memory limits, behave) like loading all of it. Reading exactly the bytes
asked for keeps consolidation and resharding at the memory of what they hold.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class SafetensorsFile:
    """A safetensors file opened for slice reads. Everything about it is checked on open (header length,
    JSON, each tensor's dtype, shape and byte range within the file), so a foreign, truncated or corrupt
    file is refused with its path and what is wrong, never a raw decoding or struct error later."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot be opened ({e.strerror}).") from None
        try:
            size = os.fstat(self._fd).st_size
            self._entries, self._metadata, self._base = _parse_header(self.path, self._fd, size)
        except OSError as e:
            os.close(self._fd)
            raise CheckpointError(f"{self.path}: cannot be read ({e.strerror}).") from None
        except BaseException:
            os.close(self._fd)
            raise

    def keys(self) -> list[str]:
        return list(self._entries)

    def metadata(self) -> dict[str, str]:
        return self._metadata

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._entry(key)["shape"])

    def numel(self, key: str) -> int:
        return _numel(self._entry(key)["shape"])

    def _entry(self, key: str) -> dict[str, Any]:
        if key not in self._entries:
            raise CheckpointError(f"{self.path}: has no tensor {key!r}; the file is not the one its checkpoint's "
                                  "manifest describes (replaced or from another checkpoint).")
        return self._entries[key]

    def _read(self, start: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        data = bytearray(nbytes)
        view, done = memoryview(data), 0
        while done < nbytes:
            try:
                got = os.preadv(self._fd, [view[done:]], self._base + start + done)
            except OSError as e:
                raise CheckpointError(f"{self.path}: read failed at byte {self._base + start + done} ({e.strerror}).") from None
            if got == 0:
                raise CheckpointError(f"{self.path}: truncated at byte {self._base + start + done}; the file is "
                                      "shorter than its header says.")
            done += got
        return torch.frombuffer(data, dtype=dtype) if nbytes else torch.empty(0, dtype=dtype)

    def get_tensor(self, key: str) -> torch.Tensor:
        entry = self._entry(key)
        dtype = _DTYPES[entry["dtype"]]
        begin, end = entry["data_offsets"]
        return self._read(begin, end - begin, dtype).view(entry["shape"])

    def read_range(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of a flat (1-D) tensor."""
        entry = self._entry(key)
        numel = _numel(entry["shape"])
        if not 0 <= lo <= hi <= numel:
            raise CheckpointError(f"{self.path}: tensor {key!r} has {numel} elements (shape {tuple(entry['shape'])}); "
                                  f"elements [{lo}, {hi}) were asked for. The manifest does not describe this file.")
        dtype = _DTYPES[entry["dtype"]]
        size = torch.empty((), dtype=dtype).element_size()
        begin = entry["data_offsets"][0]
        return self._read(begin + lo * size, (hi - lo) * size, dtype)

    def close(self) -> None:
        os.close(self._fd)


def _parse_header(path: Path, fd: int, size: int) -> tuple[dict[str, Any], dict[str, str], int]:
    """(tensor entries, metadata, offset of the data) of the file open at `fd`, checked against its size."""
    def refuse(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: {what}; it is not a safetensors file, or it is truncated or corrupt.")

    if size < 8:
        raise refuse(f"{size} bytes long, shorter than the 8-byte header length")
    (length,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if length > size - 8:
        raise refuse(f"its header claims {length} bytes but the file has {size}")
    try:
        header = json.loads(os.pread(fd, length, 8).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise refuse(f"its header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise refuse("its header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise refuse("its __metadata__ is not a map of strings")
    data_bytes = size - 8 - length
    for key, entry in header.items():
        problem = _entry_problem(entry, data_bytes)
        if problem:
            raise refuse(f"tensor {key!r} {problem}")
    return header, metadata, 8 + length


def _entry_problem(entry: Any, data_bytes: int) -> str | None:
    if not isinstance(entry, dict) or entry.get("dtype") not in _DTYPES:
        return f"has no known dtype ({entry!r:.80})"
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        return f"has shape {shape!r:.80}, not a list of sizes"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_bytes):
        return f"has byte range {offsets!r:.80}, outside the {data_bytes} data bytes"
    nbytes = _numel(shape) * torch.empty((), dtype=_DTYPES[entry["dtype"]]).element_size()
    if offsets[1] - offsets[0] != nbytes:
        return f"has shape {tuple(shape)} of {entry['dtype']} ({nbytes} bytes) but a {offsets[1] - offsets[0]}-byte range"
    return None


def _numel(shape: list[int]) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel


_NAMES = {v: k for k, v in _DTYPES.items()}


class SafetensorsWriter:
    """Write a safetensors file tensor by tensor: the header is written first from the specs, so the
    whole file never has to be in memory at once."""

    def __init__(self, path: str | Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        header: dict[str, Any] = {"__metadata__": metadata or {}}
        offset = 0
        self._order = []
        for name, dtype, shape in specs:
            numel = 1
            for d in shape:
                numel *= d
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._order.append((name, dtype, nbytes))
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # keep the data 8-byte aligned
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(blob)) + blob)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected, dtype, nbytes = self._order[self._next]
        if name != expected or tensor.dtype != dtype or tensor.numel() * tensor.element_size() != nbytes:
            raise ValueError(f"safetensors writer: expected {expected} ({dtype}, {nbytes} bytes); got {name} "
                             f"({tensor.dtype}, {tensor.numel() * tensor.element_size()} bytes).")
        self._file.write(tensor.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes())
        self._next += 1

    def close(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
