"""Full fp32 weights from a checkpoint, under DeepSpeed's `zero_to_fp32` names.

`get_fp32_state_dict_from_zero_checkpoint`, `convert_zero_checkpoint_to_fp32_state_dict`,
`convert_zero_checkpoint_to_state_dict` and `load_state_dict_from_zero_checkpoint` take DeepSpeed's
arguments and read shardwise checkpoints (any world size, any stage): trainable parameters come from
their fp32 masters, frozen ones from their stored values, plus the persistent buffers, as DeepSpeed's
tool returns them. `python -m shardwise.checkpoint.fp32 CHECKPOINT_DIR OUTPUT_DIR` is its command line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .cli import parse_size
from .consolidate import _specs, _tensor, consolidate
from .errors import CheckpointError
from .reader import open_checkpoint

if TYPE_CHECKING:
    from .reader import AnyReader

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


class LazyTensor:
    """One tensor of a checkpoint, read when `.contiguous()` is called (DeepSpeed's `lazy_mode`)."""

    def __init__(self, reader: AnyReader, name: str, dtype: torch.dtype):
        self.reader, self.name, self.dtype = reader, name, dtype

    def contiguous(self) -> torch.Tensor:
        return _tensor(self.reader, self.name, self.dtype)


def _dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: one of {', '.join(_DTYPES)} or a torch dtype; got {dtype!r}.")
    return _DTYPES[dtype]


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | Path, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, Any]:
    """Name → full fp32 tensor (on the CPU) for every parameter and persistent buffer of the checkpoint;
    with `lazy_mode`, name → `LazyTensor` whose `.contiguous()` reads it."""
    reader = open_checkpoint(checkpoint_dir, tag)
    lazy = {name: LazyTensor(reader, name, dtype)
            for name, dtype, _ in _specs(reader, torch.float32, exclude_frozen_parameters)}
    return lazy if lazy_mode else {name: t.contiguous() for name, t in lazy.items()}


def convert_zero_checkpoint_to_state_dict(checkpoint_dir: str | Path, output_dir: str | Path,
                                          dtype: torch.dtype | str = torch.float32, max_shard_size: str | int = "5GB",
                                          safe_serialization: bool = False, tag: str | None = None,
                                          exclude_frozen_parameters: bool = False) -> list[Path]:
    """Write the full weights into `output_dir`: `model*.safetensors` with `safe_serialization`, else
    DeepSpeed's `pytorch_model*.bin` (torch.save); sharded with an index above `max_shard_size`."""
    limit = parse_size(max_shard_size) if isinstance(max_shard_size, str) else int(max_shard_size)
    return consolidate(checkpoint_dir, output_dir, tag, limit, _dtype(dtype), exclude_frozen=exclude_frozen_parameters,
                       pickle_format=not safe_serialization)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | Path, output_dir: str | Path,
                                               max_shard_size: str | int = "5GB", safe_serialization: bool = False,
                                               tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> list[Path]:
    return convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, torch.float32, max_shard_size,
                                                 safe_serialization, tag, exclude_frozen_parameters)


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str | Path,
                                         tag: str | None = None) -> torch.nn.Module:
    """Move `model` to the CPU and load the checkpoint's full fp32 weights into it (strictly: a parameter
    the checkpoint lacks, or one it has that the model lacks, is an error naming them)."""
    model = model.cpu()
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model.load_state_dict(state, strict=True)
    return model


def clone_tensors_for_torch_save(item: Any, device: torch.device = torch.device("cpu")) -> Any:
    """`item` (a tensor, or lists/tuples/dicts of them) with every tensor copied to `device`, detached and
    with storage of its own, so that `torch.save` writes only the tensor's elements, not a view's base."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zero_to_fp32",
                                     description="Write the full fp32 weights of a shardwise checkpoint.")
    parser.add_argument("checkpoint_dir", help="the folder holding the tag folders (and 'latest')")
    parser.add_argument("output_dir", help="where the weight files go")
    parser.add_argument("--max_shard_size", default="5GB")
    parser.add_argument("--safe_serialization", action="store_true", help="safetensors instead of torch.save")
    parser.add_argument("-t", "--tag", default=None)
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    parser.add_argument("-d", "--debug", action="store_true", help="accepted for DeepSpeed's script; no effect")
    args = parser.parse_args(argv)
    try:
        paths = convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_dir, args.max_shard_size,
                                                           args.safe_serialization, args.tag,
                                                           args.exclude_frozen_parameters)
    except CheckpointError as e:
        print(f"zero_to_fp32: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
