"""Read a checkpoint tag by parameter name and element range, whatever layout wrote it.

Files are opened lazily and verified (size and CRC32 against the manifest) the first time they
are touched; only the requested slices are read (safetensors slicing), so loading streams. Whatever is
wrong with a file (missing, corrupt, truncated, foreign, not matching the manifest) is a CheckpointError
that names it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..tensor_parallel.shard import TensorShard, assemble, take
from . import layout
from .deepspeed_layout import deepspeed_checkpoint_message, deepspeed_tag_dir
from .errors import CheckpointError
from .manifest import read_manifest
from .safetensors_file import SafetensorsFile
from .tags import load_tag_problem

if TYPE_CHECKING:
    from .deepspeed_reader import DeepSpeedReader


def resolve_tag(load_dir: str | Path, tag: str | None) -> Path:
    """The tag directory to load: `tag`, or the one `latest` names. Neither may lead out of `load_dir`."""
    root = Path(load_dir)
    if (root / layout.MANIFEST).is_file() and tag is None:
        return root  # pointed straight at a tag directory
    if tag is None:
        latest = root / layout.LATEST
        if not latest.is_file():
            raise CheckpointError(deepspeed_checkpoint_message(root) or f"{latest}: no 'latest' file; pass tag= or "
                                  "point at a checkpoint tag directory.")
        try:
            tag = latest.read_bytes().decode("utf-8").strip()
        except UnicodeDecodeError:
            raise CheckpointError(f"{latest}: not text; it should hold the name of a tag directory in {root}. "
                                  "Pass tag= or rewrite it.") from None
        if load_tag_problem(tag):
            raise CheckpointError(f"{latest}: names {tag!r}, but it must name a tag directory inside {root} (one "
                                  "directory name: no '/', '..', NUL or newline); it was not followed. Pass tag= or "
                                  "write a tag name into it.")
    problem = load_tag_problem(str(tag))
    if problem:
        raise CheckpointError(f"load_checkpoint: tag {problem} inside {root}; got {tag!r}.")
    return root / str(tag)


def open_checkpoint(load_dir: str | Path, tag: str | None = None, verify: bool = True) -> CheckpointReader | DeepSpeedReader:
    """A reader of the checkpoint `load_dir` and `tag` lead to: shardwise's own (`CheckpointReader`), or one
    DeepSpeed wrote (`DeepSpeedReader`, which answers the same questions)."""
    if tag is None or not load_tag_problem(str(tag)):
        found = deepspeed_tag_dir(Path(load_dir), tag)
        if found is not None:
            from .deepspeed_reader import DeepSpeedReader
            from .deepspeed_universal import UniversalReader, is_universal

            return UniversalReader(found) if is_universal(found) else DeepSpeedReader(found)
    return CheckpointReader(load_dir, tag, verify)


class CheckpointReader:
    def __init__(self, load_dir: str | Path, tag: str | None = None, verify: bool = True):
        self.path = resolve_tag(load_dir, tag)
        self.meta = read_manifest(self.path)
        self.verify = verify
        self._open: dict[str, SafetensorsFile] = {}
        self._cached_whole: tuple[tuple[str, str], torch.Tensor] | None = None

    def file(self, name: str) -> SafetensorsFile:
        if name not in self._open:
            path = self.path / name
            expected = self.meta["files"].get(name)
            if expected is None or not path.is_file():
                raise CheckpointError(f"{path}: missing from the checkpoint.")
            if self.verify and (path.stat().st_size != expected["bytes"] or not layout.checksum_matches(path, expected)):
                raise CheckpointError(f"{path}: size or checksum differs from the manifest; the file is corrupt or truncated.")
            self._open[name] = SafetensorsFile(path)
        return self._open[name]

    def has(self, name: str) -> bool:
        return name in self.meta["params"]

    def kinds(self, name: str) -> set[str]:
        return {k for p in self.meta["params"][name]["pieces"] for k in p["kinds"]}

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.meta["params"][name]["shape"])

    def read_into(self, name: str, kind: str, start: int, end: int, out: torch.Tensor,
                  shard: TensorShard | None = None) -> None:
        """Copy elements [start, end) of parameter `name`'s `kind` into `out` (casting to its dtype). With `shard`,
        the elements are of this rank's tensor-parallel piece of the parameter, whatever split it was saved with
        (see [Note: tensor-parallel pieces])."""
        saved = self.meta["params"][name].get("tp")
        if saved is None and shard is None:
            self._read_range(name, kind, None, start, end, out)
        elif shard is not None and saved == shard.describe():
            self._read_range(name, kind, shard.rank, start, end, out)
        else:
            whole = self._whole(name, kind, keep=True)
            local = take(whole, shard) if shard is not None else whole
            out.copy_(local.reshape(-1)[start:end])

    def _read_range(self, name: str, kind: str, part: int | None, start: int, end: int, out: torch.Tensor) -> None:
        pieces = [p for p in self.meta["params"][name]["pieces"] if kind in p["kinds"] and p.get("part") == part]
        filled = 0
        for piece, lo, hi in layout.overlaps(pieces, start, end):
            key = layout.piece_key(name, kind, piece["start"], part)
            source = self.file(piece["file"])
            if source.numel(key) != piece["end"] - piece["start"]:
                raise CheckpointError(f"{source.path}: tensor {key!r} has {source.numel(key)} elements, the manifest "
                                      f"says {piece['end'] - piece['start']}; the file does not match its manifest.")
            out[lo - start : hi - start].copy_(source.read_range(key, lo - piece["start"], hi - piece["start"]))
            filled += hi - lo
        if filled < end - start:
            where = f" (tensor-parallel part {part})" if part is not None else ""
            raise CheckpointError(f"{self.path}: {name!r} (shape {self.shape(name)}){where} has no {kind!r} for "
                                  f"elements [{start}, {end}).")

    def _whole(self, name: str, kind: str, keep: bool = False) -> torch.Tensor:
        """The whole parameter (fp32), assembled from its tensor-parallel parts. With `keep` the last one is kept,
        since a rank loading a piece usually reads several ranges of one parameter in a row (consolidation reads
        each once and keeps nothing: its peak is two tensors)."""
        if self._cached_whole is not None and self._cached_whole[0] == (name, kind):
            return self._cached_whole[1]
        entry, shape = self.meta["params"][name], self.shape(name)
        saved = entry.get("tp")
        if saved is None:
            whole = torch.empty(shape, dtype=torch.float32)
            self._read_range(name, kind, None, 0, whole.numel(), whole.view(-1))
        else:
            part_shape = TensorShard(saved["dim"], 0, saved["parts"], shape, saved["blocks"]).local_shape
            parts = [torch.empty(part_shape, dtype=torch.float32) for _ in range(saved["parts"])]
            for rank, part in enumerate(parts):
                self._read_range(name, kind, rank, 0, part.numel(), part.view(-1))
            whole = assemble(parts, saved["dim"], saved["blocks"])
        if keep:
            self._cached_whole = ((name, kind), whole)
        return whole

    def read_full(self, name: str, kind: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._whole(name, kind).to(dtype)

    def _buffer_file(self, name: str) -> SafetensorsFile:
        """Each pipeline stage's buffers are in its first replica's file (rank 0's in checkpoints that predate
        `buffer_files`, which had one stage)."""
        return self.file(self.meta.get("buffer_files", {}).get(name, layout.rank_file(0)))

    def buffer(self, name: str) -> torch.Tensor:
        return self._buffer_file(name).get_tensor(layout.buffer_key(name))

    def buffer_shape(self, name: str) -> tuple[int, ...]:
        return self._buffer_file(name).shape(layout.buffer_key(name))

    def rank_local(self, rank: int) -> dict[str, torch.Tensor]:
        """What `rank` saved for itself (`ShardingStrategy.rank_local_state`), by name; {} if nothing."""
        name = layout.rank_file(rank)
        if name not in self.meta["files"]:
            return {}
        f = self.file(name)
        return {k.removeprefix(layout.RANK_LOCAL): f.get_tensor(k) for k in f.keys() if k.startswith(layout.RANK_LOCAL)}

    def rng(self, rank: int) -> tuple[dict[str, torch.Tensor], str] | None:
        name = layout.rank_file(rank)
        if name not in self.meta["files"] or self.meta.get("origin") == "deepspeed":  # imported: DeepSpeed keeps none
            return None
        f = self.file(name)
        text = f.metadata().get("rng")
        try:
            json.loads(text or "")
        except json.JSONDecodeError:
            raise CheckpointError(f"{f.path}: has no readable RNG state in its metadata; the file is not one "
                                  "shardwise wrote.") from None
        return {k: f.get_tensor(k) for k in f.keys() if k.startswith("rng|")}, text


if TYPE_CHECKING:
    AnyReader = CheckpointReader | DeepSpeedReader
    """Either reader: `open_checkpoint`'s answer, which the loader and the consolidation tools take."""
