"""shardwise's safetensors reader and writer (checkpoint/safetensors_file.py) share one dtype table that holds
every dtype torch has and the safetensors format defines; each round-trips bit-exactly against the
`safetensors` package's own writer and reader."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardwise.checkpoint.errors import CheckpointError
from shardwise.checkpoint.safetensors_file import DTYPES, SafetensorsFile, SafetensorsWriter


def _header(path: Path) -> dict:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length])


def _safetensors_dtypes(tmp: Path) -> dict[str, torch.dtype]:
    """Every torch dtype the `safetensors` package writes, by the name it writes in the header."""
    found = {}
    for dtype in {d for d in vars(torch).values() if isinstance(d, torch.dtype)}:
        try:
            save_file({"x": torch.zeros(1, 8, dtype=torch.uint8).view(dtype)}, tmp / "probe.safetensors")
        except Exception:  # a dtype the format does not define (complex128, quantized, uint1-7, ...)
            continue
        found[_header(tmp / "probe.safetensors")["x"]["dtype"]] = dtype
    return found


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bytes viewed as `dtype` (bools as 0/1), so every bit pattern of the format can show up."""
    size = torch.empty((), dtype=dtype).element_size()
    high = 2 if dtype == torch.bool else 256
    raw = torch.randint(0, high, (*shape[:-1], shape[-1] * size), generator=torch.Generator().manual_seed(seed),
                        dtype=torch.uint8)
    return raw.view(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_the_table_is_every_dtype_safetensors_writes(tmp_path: Path) -> None:
    assert DTYPES == _safetensors_dtypes(tmp_path)
    for name in ("F8_E4M3", "F8_E5M2", "F8_E8M0", "U16", "U32", "U64", "F4", "C64"):
        assert name in DTYPES


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_each_dtype_round_trips_with_the_safetensors_package(name: str, tmp_path: Path) -> None:
    dtype = DTYPES[name]
    tensors = {"matrix": _sample(dtype, (3, 4), 0), "flat": _sample(dtype, (10,), 1), "empty": _sample(dtype, (0, 2), 2)}

    # shardwise writes, safetensors reads: same bits, dtype and shape, and the header names the dtype as it does.
    ours = tmp_path / "ours.safetensors"
    writer = SafetensorsWriter(ours, [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()], {"format": "pt"})
    for key, tensor in tensors.items():
        writer.write(key, tensor)
    writer.close()
    for key, tensor in load_file(ours).items():
        assert _same_bits(tensor, tensors[key]), key

    # safetensors writes, shardwise reads: whole tensors and slices of the flat one.
    theirs = tmp_path / "theirs.safetensors"
    save_file(tensors, theirs)
    assert {k: v["dtype"] for k, v in _header(theirs).items() if k != "__metadata__"} == \
        {k: v["dtype"] for k, v in _header(ours).items() if k != "__metadata__"} == dict.fromkeys(tensors, name)
    file = SafetensorsFile(theirs)
    try:
        for key, tensor in tensors.items():
            assert file.shape(key) == tuple(tensor.shape) and file.numel(key) == tensor.numel()
            assert _same_bits(file.get_tensor(key), tensor), key
        assert _same_bits(file.read_range("flat", 3, 8), tensors["flat"][3:8])
    finally:
        file.close()


def test_an_f4_header_with_an_odd_last_dimension_is_refused(tmp_path: Path) -> None:
    """F4 headers count 4-bit values, two per byte: an odd count cannot be a whole torch tensor."""
    header = json.dumps({"x": {"dtype": "F4", "shape": [2, 3], "data_offsets": [0, 3]}}).encode()
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(3))
    with pytest.raises(CheckpointError, match=r"tensor 'x' has shape \(2, 3\) of F4, whose last dimension .* must be even"):
        SafetensorsFile(path)


def test_the_writer_refuses_a_dtype_the_format_lacks(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"tensor 'z' needs a dtype the safetensors format defines; got torch.complex128"):
        SafetensorsWriter(tmp_path / "x.safetensors", [("z", torch.complex128, (2,))])
