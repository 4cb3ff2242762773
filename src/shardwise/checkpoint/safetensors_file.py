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

# The safetensors format's dtype names -> torch dtypes: the one table the reader and the writer share.
# Every dtype the format defines that torch has (F6_E2M3 and F6_E3M2 have no torch dtype).
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2": torch.float8_e5m2, "F8_E5M2FNUZ": torch.float8_e5m2fnuz, "F8_E8M0": torch.float8_e8m0fnu,
    "F4": torch.float4_e2m1fn_x2,
}
NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}

# [Note: packed F4] A safetensors header counts F4 values (4 bits each); torch's float4_e2m1fn_x2 packs two
# of them in one element, along the last dimension. So an F4 tensor's header shape has a last dimension
# twice the torch tensor's, and must have an even one. Every other dtype has one value per element.
_VALUES_PER_ELEMENT = {"F4": 2}


def _torch_shape(name: str, shape: list[int]) -> list[int]:
    per = _VALUES_PER_ELEMENT.get(name, 1)
    return shape if per == 1 else [*shape[:-1], shape[-1] // per]


def _file_shape(name: str, shape: tuple[int, ...]) -> list[int]:
    per = _VALUES_PER_ELEMENT.get(name, 1)
    return list(shape) if per == 1 else [*shape[:-1], shape[-1] * per]


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
        dtype = DTYPES[entry["dtype"]]
        begin, end = entry["data_offsets"]
        return self._read(begin, end - begin, dtype).view(entry["shape"])

    def read_range(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of a flat (1-D) tensor."""
        entry = self._entry(key)
        numel = _numel(entry["shape"])
        if not 0 <= lo <= hi <= numel:
            raise CheckpointError(f"{self.path}: tensor {key!r} has {numel} elements (shape {tuple(entry['shape'])}); "
                                  f"elements [{lo}, {hi}) were asked for. The manifest does not describe this file.")
        dtype = DTYPES[entry["dtype"]]
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
        entry["shape"] = _torch_shape(entry["dtype"], entry["shape"])  # from here on, the torch tensor's shape
    return header, metadata, 8 + length


def _entry_problem(entry: Any, data_bytes: int) -> str | None:
    if not isinstance(entry, dict) or entry.get("dtype") not in DTYPES:
        return f"has no known dtype ({entry!r:.80})"
    name, shape, offsets = entry["dtype"], entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        return f"has shape {shape!r:.80}, not a list of sizes"
    per = _VALUES_PER_ELEMENT.get(name, 1)  # [Note: packed F4]
    if per > 1 and (not shape or shape[-1] % per):
        return f"has shape {tuple(shape)} of {name}, whose last dimension (4-bit values, two per byte) must be even"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_bytes):
        return f"has byte range {offsets!r:.80}, outside the {data_bytes} data bytes"
    nbytes = _numel(_torch_shape(name, shape)) * torch.empty((), dtype=DTYPES[name]).element_size()
    if offsets[1] - offsets[0] != nbytes:
        return f"has shape {tuple(shape)} of {name} ({nbytes} bytes) but a {offsets[1] - offsets[0]}-byte range"
    return None


def _numel(shape: list[int]) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel


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
            if dtype not in NAMES:
                raise ValueError(f"safetensors writer: tensor {name!r} needs a dtype the safetensors format defines; "
                                 f"got {dtype}. Cast it to one of {', '.join(map(str, NAMES))}.")
            header[name] = {"dtype": NAMES[dtype], "shape": _file_shape(NAMES[dtype], shape),
                            "data_offsets": [offset, offset + nbytes]}
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
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
        finally:
            self._file.close()

    def abort(self) -> None:
        """Close after a failed write, whose error is the one to report (closing flushes, which may fail too)."""
        try:
            self._file.close()
        except OSError:
            pass
