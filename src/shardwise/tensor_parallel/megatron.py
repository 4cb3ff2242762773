"""A Megatron-style `mpu` passed to `initialize(mpu=...)`, and `tp_model_init`'s record on the model.

An mpu (an object with `get_{model,data}_parallel_{world_size,rank,group}()`, or the `tensor_model_parallel`
spellings) says how many ranks split each layer; shardwise builds its own groups from the one topology and
checks that they are the mpu's. Layers the user split themselves (Megatron's, which mark a split parameter
with `tensor_model_parallel` and `partition_dim`) are described as `TensorShard`s for checkpoints and the norm.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .apply import TensorParallelModel
from .comm import TensorLink
from .shard import TensorShard
from .styles import TensorParallelError

TP_INIT_ATTR = "_shardwise_tp_init"
"""Where `tp_model_init` records its arguments on the model (DeepSpeed 0.19 also only records them there and
splits at initialize)."""


def _call(mpu: Any, *names: str) -> Any:
    for name in names:
        if callable(getattr(mpu, name, None)):
            return getattr(mpu, name)()
    raise TensorParallelError(f"mpu: a {type(mpu).__name__} has none of {', '.join(names)}(); a Megatron-style mpu "
                              "needs get_model_parallel_world_size/rank/group and get_data_parallel_group.")


def mpu_tensor_size(mpu: Any) -> int:
    return int(_call(mpu, "get_tensor_model_parallel_world_size", "get_model_parallel_world_size"))


def check_mpu_groups(mpu: Any, tensor: dist.ProcessGroup, data: dist.ProcessGroup) -> None:
    """The mpu's groups must hold the ranks shardwise's topology puts together (tensor fastest)."""
    for label, ours, names in (("tensor", tensor, ("get_tensor_model_parallel_group", "get_model_parallel_group")),
                               ("data", data, ("get_data_parallel_group",))):
        theirs = _call(mpu, *names)
        mine, given = dist.get_process_group_ranks(ours), dist.get_process_group_ranks(theirs)
        if sorted(mine) != sorted(given):
            raise TensorParallelError(f"mpu: its {label}-parallel group on rank {dist.get_rank()} must be "
                                      f"{sorted(mine)}, as shardwise lays ranks out (pipe x data x tensor, tensor "
                                      f"fastest); got {sorted(given)}. Build the mpu's groups with adjacent ranks in "
                                      "a tensor group, as Megatron does.")


def megatron_split(model: torch.nn.Module, link: TensorLink) -> TensorParallelModel:
    """Describe a model the user split with Megatron-style layers (nothing is changed)."""
    result = TensorParallelModel(link)
    for name, param in model.named_parameters():
        if getattr(param, "tensor_model_parallel", False) or getattr(param, "model_parallel", False):
            dim = int(getattr(param, "partition_dim", 0))
            full = list(param.shape)
            full[dim] *= link.size
            result.shards[name] = TensorShard(dim, link.rank, link.size, tuple(full))
            result.split_ids.add(id(param))
    return result


def recorded_init(model: torch.nn.Module) -> dict[str, Any] | None:
    return getattr(model, TP_INIT_ATTR, None)


def tp_model_init(model: torch.nn.Module, tp_size: int, dtype: torch.dtype | None = None, config: Any = None,
                  **kwargs: Any) -> torch.nn.Module:
    """DeepSpeed's `tp_model_init`: record the tensor-parallel size; `initialize` splits the model (so LoRA
    adapters added in between are split with it). Returns the model."""
    if not isinstance(tp_size, int) or tp_size < 1:
        raise TensorParallelError(f"tp_model_init: tp_size must be a positive integer; got {tp_size!r}.")
    setattr(model, TP_INIT_ATTR, {"tp_size": tp_size, "dtype": dtype})
    return model


def set_autotp_mode(training: bool = False) -> None:
    """DeepSpeed's switch between AutoTP's inference and training instrumentation (`deepspeed.module_inject.
    layers.set_autotp_mode`): shardwise has nothing to switch, since it splits the model at `initialize` whenever
    `tensor_parallel.autotp_size` or `tp_model_init` asks; accepted so that scripts calling it run."""
