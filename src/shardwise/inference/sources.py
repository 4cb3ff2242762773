"""Where inference weights come from, read one tensor (and only this rank's tensor-parallel piece of it) at a time.

- `SafetensorsFolder`: a Hugging Face model folder (`model.safetensors`, or shards named by
  `model.safetensors.index.json`), a PEFT adapter folder (`adapter_model.safetensors`), or DeepSpeed's checkpoint
  descriptor (`{"type": "ds_model", "checkpoints": [files]}`) naming safetensors files.
- `ShardwiseCheckpoint`: a checkpoint written by `engine.save_checkpoint`, at whatever world size, ZeRO stage and
  tensor-parallel split it was trained with (checkpoint/reader.py reassembles the pieces).
- `Chain`: the first source that has a name (a base model folder, then an adapter).

A source is asked for a parameter by the model's own name; `candidates` maps that name onto the spellings the
files use (a PEFT wrapper's `base_model.model.` prefix and `.base_layer`, the adapter name peft drops on save, a
Hugging Face base-model prefix). Pickled weights (`pytorch_model.bin`) are refused: loading them runs code.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Iterator, Protocol

import torch

from ..checkpoint import layout
from ..checkpoint.errors import CheckpointError
from ..checkpoint.reader import CheckpointReader
from ..checkpoint.safetensors_file import SafetensorsFile
from ..protocols.tensor_shard import TensorShard


class WeightSource(Protocol):
    def find(self, name: str) -> str | None:
        """The key this source holds `name` under, or None."""

    def shape(self, key: str) -> tuple[int, ...]: ...

    def read(self, key: str, shard: TensorShard | None, dtype: torch.dtype) -> torch.Tensor:
        """The tensor (this rank's piece of it, with `shard`) in `dtype`."""


def candidates(name: str, adapter: str = "default", prefixes: tuple[str, ...] = ()) -> Iterator[str]:
    """The spellings a parameter of the model may have in a weight file, the model's own first."""
    seen = set()
    for own in (name, name.replace(f".{adapter}.", ".")):  # peft saves adapters without their name
        for variant in (own, own.removeprefix("base_model.model.").replace(".base_layer.", ".")):
            for spelled in (variant, *(variant.removeprefix(p) if variant.startswith(p) else p + variant
                                       for p in prefixes)):
                if spelled not in seen:
                    seen.add(spelled)
                    yield spelled


class SafetensorsFolder:
    def __init__(self, files: list[Path]):
        self.files = {}
        for path in files:
            opened = SafetensorsFile(path)
            for key in opened.keys():
                self.files.setdefault(key, opened)

    @classmethod
    def at(cls, path: str | Path) -> SafetensorsFolder:
        root = Path(path)
        index = next((root / n for n in ("model.safetensors.index.json", "adapter_model.safetensors.index.json")
                      if (root / n).is_file()), None)
        if index is not None:
            weight_map = json.loads(index.read_text())["weight_map"]
            return cls([root / f for f in dict.fromkeys(weight_map.values())])
        files = sorted(root.glob("*.safetensors"))
        if not files:
            pickled = sorted(p.name for p in root.glob("*.bin")) + sorted(p.name for p in root.glob("*.pt"))
            hint = (f" It has {pickled[:3]}: pickled weights, which shardwise does not load (unpickling runs code); "
                    "convert them with transformers' save_pretrained(safe_serialization=True).") if pickled else ""
            raise CheckpointError(f"{root}: no *.safetensors files (and no model.safetensors.index.json).{hint}")
        return cls(files)

    def find(self, name: str) -> str | None:
        return name if name in self.files else None

    def shape(self, key: str) -> tuple[int, ...]:
        return self.files[key].shape(key)

    def read(self, key: str, shard: TensorShard | None, dtype: torch.dtype) -> torch.Tensor:
        return read_piece(self.files[key], key, shard).to(dtype)


def read_piece(file: SafetensorsFile, key: str, shard: TensorShard | None) -> torch.Tensor:
    """This rank's piece of tensor `key`, reading only its bytes (see `read_ranges`)."""
    if shard is None:
        return file.get_tensor(key)
    if tuple(file.shape(key)) != shard.full_shape:
        raise CheckpointError(f"{file.path}: {key!r} has shape {tuple(file.shape(key))}; the model's parameter is "
                              f"{shard.full_shape}. The weights are not this model's (check the config).")
    return read_ranges(lambda lo, hi: file.read_range(key, lo, hi), shard)


def read_ranges(read_flat: Callable[[int, int], torch.Tensor], shard: TensorShard) -> torch.Tensor:
    """A tensor-parallel piece of a tensor stored whole and flat, from reads of element ranges [lo, hi): for each
    index of the dims before the split one and each block, the piece is one contiguous range (one range in all for
    a split along dim 0), so exactly the piece's elements are read."""
    shape, dim = shard.full_shape, shard.dim
    inner, outer = math.prod(shape[dim + 1:]), math.prod(shape[:dim])
    block = shape[dim] // shard.blocks
    piece = block // shard.size
    row = shape[dim] * inner  # elements per index of the dims before `dim`
    starts = [o * row + (b * block + shard.rank * piece) * inner for o in range(outer) for b in range(shard.blocks)]
    return torch.cat([read_flat(s, s + piece * inner) for s in starts]).view(shard.local_shape)


class ShardwiseCheckpoint:
    """A shardwise training checkpoint: `path` is the save directory (its `latest` is read) or a tag directory."""

    def __init__(self, path: str | Path, tag: str | None = None):
        self.path = str(path)
        self.reader = CheckpointReader(path, tag)

    def find(self, name: str) -> str | None:
        if self.reader.has(name):
            return name
        return name if name in self.reader.meta.get("persistent_buffers", []) else None

    def shape(self, key: str) -> tuple[int, ...]:
        return self.reader.shape(key) if self.reader.has(key) else self.reader.buffer_shape(key)

    def read(self, key: str, shard: TensorShard | None, dtype: torch.dtype) -> torch.Tensor:
        if not self.reader.has(key):
            return self.reader.buffer(key).to(dtype)
        if shard is not None and self.shape(key) != shard.full_shape:
            # the reader would cut this rank's piece out of a tensor of another shape without complaint
            raise CheckpointError(f"init_inference: {self.path!r} holds {key!r} with shape {self.shape(key)}; the "
                                  f"model's parameter has shape {shard.full_shape}. The checkpoint is not this "
                                  "model's (check the model config).")
        kind = layout.MASTER if layout.MASTER in self.reader.kinds(key) else layout.VALUE
        saved = self.reader.meta["params"][key].get("tp")
        if shard is not None and saved is None:  # saved whole: read only this rank's ranges of it
            return read_ranges(lambda lo, hi: self._range(key, kind, lo, hi), shard).to(dtype)
        out = torch.empty(shard.local_shape if shard is not None else self.shape(key), dtype=torch.float32)
        self.reader.read_into(key, kind, 0, out.numel(), out.view(-1), shard)  # other splits: assembled, then cut
        return out.to(dtype)

    def _range(self, key: str, kind: str, lo: int, hi: int) -> torch.Tensor:
        out = torch.empty(hi - lo, dtype=torch.float32)
        self.reader.read_into(key, kind, lo, hi, out)
        return out


class Chain:
    def __init__(self, *sources: WeightSource):
        self.sources = sources
        self._owner: dict[str, WeightSource] = {}

    def find(self, name: str) -> str | None:
        for source in self.sources:
            key = source.find(name)
            if key is not None:
                self._owner[key] = source
                return key
        return None

    def shape(self, key: str) -> tuple[int, ...]:
        return self._owner[key].shape(key)

    def read(self, key: str, shard: TensorShard | None, dtype: torch.dtype) -> torch.Tensor:
        return self._owner[key].read(key, shard, dtype)


def open_source(checkpoint: str | dict | WeightSource, base_dir: str = "") -> WeightSource:
    """`init_inference`'s `checkpoint=`: a shardwise checkpoint, a safetensors folder, DeepSpeed's descriptor (a
    dict or a JSON file naming safetensors files, relative to `base_dir`), or a source built already."""
    if not isinstance(checkpoint, (str, Path, dict)):
        return checkpoint
    if isinstance(checkpoint, dict):
        return _descriptor(checkpoint, base_dir)
    path = Path(base_dir) / checkpoint if base_dir else Path(checkpoint)
    if path.is_file() and path.suffix == ".json":
        return _descriptor(json.loads(path.read_text()), base_dir or str(path.parent))
    if path.is_file() and path.suffix == ".safetensors":
        return SafetensorsFolder([path])
    if not path.is_dir():
        raise CheckpointError(f"init_inference: checkpoint {str(path)!r} does not exist; pass a shardwise checkpoint "
                              "directory, a Hugging Face safetensors folder, or a descriptor JSON.")
    if (path / layout.LATEST).is_file() or (path / layout.MANIFEST).is_file():
        return ShardwiseCheckpoint(path)
    return SafetensorsFolder.at(path)


def _descriptor(desc: dict, base_dir: str) -> WeightSource:
    files = desc.get("checkpoints")
    if isinstance(files, dict):  # DeepSpeed's {"non_tp": [...], "tp": [...]}
        files = [*files.get("non_tp", []), *files.get("tp", [])]
    if not isinstance(files, list) or not files:
        raise CheckpointError(f"init_inference: a checkpoint descriptor needs \"checkpoints\": [files]; got {desc!r}.")
    if desc.get("type", "ds_model").lower() not in ("ds_model", "safetensors", "bloom"):
        raise CheckpointError(f"init_inference: checkpoint type {desc.get('type')!r} is not read by shardwise; it "
                              "reads safetensors files (type \"ds_model\") and shardwise checkpoints.")
    paths = [Path(base_dir) / f for f in files]
    pickled = [str(p) for p in paths if p.suffix != ".safetensors"]
    if pickled:
        raise CheckpointError(f"init_inference: {pickled[:3]} are not safetensors files; shardwise does not unpickle "
                              "weights (it runs code). Convert them with save_pretrained(safe_serialization=True).")
    return SafetensorsFolder(paths)
