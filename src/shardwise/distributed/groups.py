"""DeepSpeed's `deepspeed.utils.groups` getters (tensor- and data-parallel group, rank, size), answered from the
topology the latest `initialize` built.

[Note: the latest topology] Those getters take no argument (scripts call `groups.get_data_parallel_rank()` to
shard their data after `initialize`), so they need a process-wide record of the mesh: `initialize` records
its topology here, and nothing else in shardwise reads it; components get their groups passed explicitly.

As in DeepSpeed 0.19.8, the "model-parallel" getters here are the tensor-parallel ones (unlike `engine.grid`'s
`get_model_parallel_*`, which span pipe × tensor, as DeepSpeed's pipeline grid does).
"""

from __future__ import annotations

import torch.distributed as dist

from .topology import Group, Topology

_latest: list[Topology] = []
"""The latest `initialize`'s topology (at most one), see [Note: the latest topology]."""


class GroupsNotReadyError(RuntimeError):
    """A `deepspeed.utils.groups` getter called before `initialize` built the groups."""


def record(topology: Topology) -> None:
    _latest[:] = [topology]


def _group(axis: str, caller: str) -> Group:
    if not _latest:
        raise GroupsNotReadyError(f"deepspeed.utils.groups.{caller}(): the process groups are built by "
                                  "initialize(); call it after deepspeed.initialize / shardwise.initialize.")
    return _latest[0].group(axis)


def get_tensor_model_parallel_group() -> dist.ProcessGroup:
    return _group("tensor", "get_tensor_model_parallel_group").pg


def get_tensor_model_parallel_world_size() -> int:
    return _group("tensor", "get_tensor_model_parallel_world_size").size


def get_tensor_model_parallel_rank() -> int:
    return _group("tensor", "get_tensor_model_parallel_rank").rank


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of tensor-parallel rank 0 in this rank's group."""
    return dist.get_global_rank(get_tensor_model_parallel_group(), 0)


def get_data_parallel_group() -> dist.ProcessGroup:
    return _group("data", "get_data_parallel_group").pg


def get_data_parallel_world_size() -> int:
    return _group("data", "get_data_parallel_world_size").size


def get_data_parallel_rank() -> int:
    return _group("data", "get_data_parallel_rank").rank


get_model_parallel_group = get_tensor_model_parallel_group
get_model_parallel_world_size = get_tensor_model_parallel_world_size
get_model_parallel_rank = get_tensor_model_parallel_rank

__all__ = ["GroupsNotReadyError", "get_data_parallel_group", "get_data_parallel_rank", "get_data_parallel_world_size",
           "get_model_parallel_group", "get_model_parallel_rank", "get_model_parallel_world_size",
           "get_tensor_model_parallel_group", "get_tensor_model_parallel_rank", "get_tensor_model_parallel_src_rank",
           "get_tensor_model_parallel_world_size", "record"]
