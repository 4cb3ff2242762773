"""DeepSpeed's `parallel_state_sp` (the mpu accelerate hands to `initialize`) and the sequence-parallel getters of
`deepspeed.utils.groups`, answered from this process's link (see [Note: one link per process] in link.py).

The sequence-data-parallel group (DeepSpeed's name for where gradients are averaged under sequence parallelism)
is every rank: sequence parallelism runs beside data parallelism only (setup.py refuses pipeline and tensor
splits with it).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from .link import SequenceLink, SequenceParallelError, recorded_link, sequence_link


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    if sequence_parallel_size <= 1:
        raise SequenceParallelError(f"sequence_parallel_size: must be greater than 1; got {sequence_parallel_size}.")
    sequence_link(sequence_parallel_size)


def _link(caller: str) -> SequenceLink:
    link = recorded_link()
    if link is None:
        raise SequenceParallelError(f"{caller}(): the sequence-parallel groups are not built; call "
                                    "initialize_sequence_parallel(size) (or register_with_transformers) first.")
    return link


def get_sequence_parallel_group() -> Any:
    return _link("get_sequence_parallel_group").group.pg


def get_sequence_parallel_world_size() -> int:
    return _link("get_sequence_parallel_world_size").size


def get_sequence_parallel_rank() -> int:
    return _link("get_sequence_parallel_rank").rank


def get_sequence_data_parallel_group() -> Any:
    _link("get_sequence_data_parallel_group")
    return dist.group.WORLD


def get_sequence_data_parallel_world_size() -> int:
    _link("get_sequence_data_parallel_world_size")
    return dist.get_world_size()


def get_sequence_data_parallel_rank() -> int:
    _link("get_sequence_data_parallel_rank")
    return dist.get_rank()


# DeepSpeed's mpu aliases its "model-parallel" getters to the sequence ones (setup.is_sequence_mpu tells them apart)
get_model_parallel_rank = get_sequence_parallel_rank
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_group = get_sequence_parallel_group


# `deepspeed.utils.groups`' sequence getters: size 1, rank 0 and no group without sequence parallelism
def current_sequence_parallel_world_size() -> int:
    link = recorded_link()
    return link.size if link is not None else 1


def current_sequence_parallel_rank() -> int:
    link = recorded_link()
    return link.rank if link is not None else 0


def current_sequence_parallel_group() -> Any:
    link = recorded_link()
    return link.group.pg if link is not None else None


def current_sequence_data_parallel_group() -> Any:
    return dist.group.WORLD


def current_sequence_data_parallel_world_size() -> int:
    return dist.get_world_size()


def current_sequence_data_parallel_rank() -> int:
    return dist.get_rank()
