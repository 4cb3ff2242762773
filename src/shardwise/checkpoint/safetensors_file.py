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

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class SafetensorsFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        (length,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
        header: dict[str, Any] = json.loads(os.pread(self._fd, length, 8))
        self._metadata: dict[str, str] = header.pop("__metadata__", {}) or {}
        self._entries = header
        self._base = 8 + length

    def keys(self) -> list[str]:
        return list(self._entries)

    def metadata(self) -> dict[str, str]:
        return self._metadata

    def _read(self, start: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        data = bytearray(nbytes)
        view, done = memoryview(data), 0
        while done < nbytes:
            got = os.preadv(self._fd, [view[done:]], self._base + start + done)
            if got == 0:
                raise EOFError(f"{self.path}: truncated at byte {self._base + start + done}")
            done += got
        return torch.frombuffer(data, dtype=dtype) if nbytes else torch.empty(0, dtype=dtype)

    def get_tensor(self, key: str) -> torch.Tensor:
        entry = self._entries[key]
        dtype = _DTYPES[entry["dtype"]]
        begin, end = entry["data_offsets"]
        return self._read(begin, end - begin, dtype).view(entry["shape"])

    def read_range(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of a flat (1-D) tensor."""
        entry = self._entries[key]
        dtype = _DTYPES[entry["dtype"]]
        size = torch.empty((), dtype=dtype).element_size()
        begin = entry["data_offsets"][0]
        return self._read(begin + lo * size, (hi - lo) * size, dtype)

    def close(self) -> None:
        os.close(self._fd)


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
