"""torch.distributed's functions under DeepSpeed's `deepspeed.comm` signatures.

DeepSpeed's communication module is torch.distributed with a few extra keywords (`prof`, `log_name`,
`debug`, for its comms logger) and a few names of its own (`get_local_rank`, `allgather_fn`,
`reduce_scatter_fn`, `inference_all_reduce`, `has_*` feature probes). These are the user's own
collectives, so they go straight to torch.distributed on the group the user names; the engine's
traffic keeps passing through `collectives.py`, where shardwise counts and times it.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from .env import DistEnv, launched
from .init import init_distributed

_DEEPSPEED_ONLY = ("prof", "log_name", "debug")


def _torch(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` accepting (and ignoring) DeepSpeed's comms-logger keywords."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        for key in _DEEPSPEED_ONLY:
            kwargs.pop(key, None)
        return fn(*args, **kwargs)

    return call


all_reduce = _torch(dist.all_reduce)
inference_all_reduce = all_reduce
reduce = _torch(dist.reduce)
broadcast = _torch(dist.broadcast)
all_gather = _torch(dist.all_gather)
all_gather_into_tensor = _torch(dist.all_gather_into_tensor)
reduce_scatter = _torch(dist.reduce_scatter)
reduce_scatter_tensor = _torch(dist.reduce_scatter_tensor)
all_to_all_single = _torch(dist.all_to_all_single)
all_to_all = _torch(dist.all_to_all)
gather = _torch(dist.gather)
scatter = _torch(dist.scatter)
send = _torch(dist.send)
recv = _torch(dist.recv)
isend = _torch(dist.isend)
irecv = _torch(dist.irecv)
barrier = _torch(dist.barrier)
monitored_barrier = _torch(dist.monitored_barrier)
broadcast_object_list = _torch(dist.broadcast_object_list)
all_gather_object = _torch(dist.all_gather_object)
batch_isend_irecv = dist.batch_isend_irecv
P2POp = dist.P2POp
new_group = dist.new_group
destroy_process_group = dist.destroy_process_group
is_initialized = dist.is_initialized
is_available = dist.is_available
get_global_rank = dist.get_global_rank


def get_world_group() -> Any:
    return dist.group.WORLD


def get_rank(group: Any = None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else _before_init("get_rank", group).rank


def get_world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else _before_init("get_world_size", group).world_size


def get_local_rank() -> int:
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    if not dist.is_initialized():
        return _before_init("get_local_rank", None).local_rank
    env = launched()
    return env.local_rank if env is not None else 0  # DeepSpeed's answer once a group exists without a launcher


def _before_init(caller: str, group: Any) -> DistEnv:
    """DeepSpeed asserts here. The launcher's variables are what init_distributed joins with, so they answer;
    without any, the rank is not known yet (mp.spawn hands it to init_process_group), and 0 could be wrong."""
    if group is not None:
        raise RuntimeError(f"comm.{caller}(group=...): torch.distributed is not initialised, so no group exists yet; "
                           "call deepspeed.init_distributed() (or initialize) first.")
    env = launched()
    if env is None:
        raise RuntimeError(
            f"comm.{caller}(): torch.distributed is not initialised and no launcher's variables (RANK/WORLD_SIZE, "
            "OMPI_COMM_WORLD_*, PMI_RANK, SLURM_PROCID, PET_*) say this process's rank; call "
            "deepspeed.init_distributed() (or initialize) first, as DeepSpeed requires.")
    return env


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    return dist.get_process_group_ranks(group or dist.group.WORLD)


def allgather_fn(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None,
                 async_op: bool = False, debug: Any = None) -> Any:
    return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_fn(output_tensor: torch.Tensor, input_tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                      group: Any = None, async_op: bool = False, prof: bool = False, debug: Any = None) -> Any:
    return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def has_all_reduce_coalesced() -> bool:
    return False


def has_coalescing_manager() -> bool:
    return False


def configure(*args: Any, **kwargs: Any) -> None:
    """DeepSpeed configures its comms logger here; shardwise's is the config's `comms_logger` section."""


def log_summary(*args: Any, **kwargs: Any) -> None:
    """DeepSpeed prints its comms log here; shardwise prints the engine's with `engine.comms_summary()`."""


__all__ = [
    "P2POp", "ReduceOp", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all",
    "all_to_all_single", "allgather_fn", "barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list",
    "configure", "destroy_process_group", "gather", "get_all_ranks_from_group", "get_global_rank", "get_local_rank",
    "get_rank", "get_world_group", "get_world_size", "has_all_gather_into_tensor", "has_all_reduce_coalesced",
    "has_coalescing_manager", "has_reduce_scatter_tensor", "inference_all_reduce", "init_distributed", "irecv",
    "is_available", "is_initialized", "isend", "log_summary", "monitored_barrier", "new_group", "recv", "reduce",
    "reduce_scatter", "reduce_scatter_fn", "reduce_scatter_tensor", "scatter", "send",
]
