"""`deepspeed.utils.groups`: the tensor- and data-parallel getters, from the groups `initialize` built, and the
sequence-parallel ones, from the Ulysses groups."""

from shardwise.distributed.groups import (
    get_data_parallel_group,
    get_data_parallel_rank,
    get_data_parallel_world_size,
    get_model_parallel_group,
    get_model_parallel_rank,
    get_model_parallel_world_size,
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_src_rank,
    get_tensor_model_parallel_world_size,
)
from shardwise.sequence_parallel.mpu import (
    current_sequence_data_parallel_group as _get_sequence_data_parallel_group,
    current_sequence_data_parallel_rank as _get_sequence_data_parallel_rank,
    current_sequence_data_parallel_world_size as _get_sequence_data_parallel_world_size,
    current_sequence_parallel_group as _get_sequence_parallel_group,
    current_sequence_parallel_rank as _get_sequence_parallel_rank,
    current_sequence_parallel_world_size as _get_sequence_parallel_world_size,
)

__all__ = [
    "_get_sequence_data_parallel_group", "_get_sequence_data_parallel_rank", "_get_sequence_data_parallel_world_size",
    "_get_sequence_parallel_group", "_get_sequence_parallel_rank", "_get_sequence_parallel_world_size",
    "get_data_parallel_group", "get_data_parallel_rank", "get_data_parallel_world_size", "get_model_parallel_group",
    "get_model_parallel_rank", "get_model_parallel_world_size", "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank", "get_tensor_model_parallel_src_rank", "get_tensor_model_parallel_world_size",
]
