"""Pure checkpoint layout: names of files and tensors, and range arithmetic. No torch.distributed.

A checkpoint tag is a directory:
  manifest.json            versions, config, topology, counters, scheduler/scaler state, optimizer
                           hyper-parameters, and for every parameter its shape and pieces
  rank{r}.safetensors      the pieces rank r held (fp32 masters, optimizer state slices, frozen
                           values), buffers (rank 0), and rank r's RNG state
Each piece covers elements [start, end) of a flattened parameter; `piece_key(name, kind, start)` is
its tensor name. Kinds: "master" (fp32 trainable values), "value" (a frozen parameter as stored),
"state.<key>" (an element-wise optimizer state such as exp_avg).

[Note: tensor-parallel pieces] A parameter split over tensor-parallel ranks is recorded at its whole shape with
`"tp": {"dim", "parts", "blocks"}` (tensor_parallel/shard.py), and each piece names its `part` (the
tensor-parallel rank): its [start, end) count elements of that part, flattened. A parameter left whole is
written by tensor-parallel rank 0 only. A reader at the same split reads its part's ranges directly; at any
other split (or none) it assembles the whole parameter from its parts and takes its own piece, one
parameter at a time: the "universal checkpoint" conversion, done at load time.
"""

from __future__ import annotations

import hashlib
import zlib
from pathlib import Path
from typing import Iterator

FORMAT_VERSION = 2
MANIFEST = "manifest.json"
LATEST = "latest"
RANK_LOCAL = "local|"
"""Prefix of the tensors a rank keeps for itself (`ShardingStrategy.rank_local_state`) in its own file."""
MASTER, VALUE = "master", "value"


def rank_file(rank: int) -> str:
    return f"rank{rank}.safetensors"


def partial_dir(save_dir: Path, tag: str) -> Path:
    """Where a tag is written before it is complete; never taken for a checkpoint."""
    return save_dir / f".{tag}.partial"


def piece_key(name: str, kind: str, start: int, part: int | None = None) -> str:
    """A piece's tensor name; `part` is the tensor-parallel rank whose piece of the parameter it is."""
    return f"{name}|{kind}|{start}" if part is None else f"{name}|{kind}|{start}|tp{part}"


def buffer_key(name: str) -> str:
    return f"buffer|{name}"


def overlaps(pieces: list[dict], start: int, end: int) -> Iterator[tuple[dict, int, int]]:
    """For each piece overlapping [start, end): (piece, lo, hi), the overlap in parameter coordinates."""
    for piece in pieces:
        lo, hi = max(start, piece["start"]), min(end, piece["end"])
        if lo < hi:
            yield piece, lo, hi


def covered_parts(entry: dict) -> bool:
    """Whether a manifest entry's pieces cover its parameter: each tensor-parallel part whole (see [Note:
    tensor-parallel pieces]), or the whole parameter when it was not split."""
    numel = 1
    for d in entry["shape"]:
        numel *= d
    split = entry.get("tp")
    if split is None:
        return covered(entry["pieces"], numel)
    return all(covered([p for p in entry["pieces"] if p.get("part") == part], numel // split["parts"])
               for part in range(split["parts"]))


def covered(pieces: list[dict], numel: int) -> bool:
    """Whether the pieces cover [0, numel) with no gap."""
    at = 0
    for piece in sorted(pieces, key=lambda p: p["start"]):
        if piece["start"] > at:
            return False
        at = max(at, piece["end"])
    return at >= numel


def _read_blocks(path: Path, chunk: int = 1 << 22) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while block := f.read(chunk):
            yield block


def crc32_of(path: Path) -> str:
    """The checksum a manifest records: CRC32 catches the corruption a checkpoint meets (truncation, flipped
    bytes, a half-copied file) at ~3x SHA-256's speed, and verifying it is part of every load."""
    crc = 0
    for block in _read_blocks(path):
        crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def sha256_of(path: Path) -> str:
    """What manifests recorded before CRC32; still verified when a checkpoint has it."""
    digest = hashlib.sha256()
    for block in _read_blocks(path):
        digest.update(block)
    return digest.hexdigest()


def checksum_matches(path: Path, recorded: dict) -> bool:
    """Whether `path` has the checksum its manifest entry records (CRC32, or SHA-256 in older checkpoints)."""
    if "crc32" in recorded:
        return crc32_of(path) == recorded["crc32"]
    return sha256_of(path) == recorded["sha256"]
