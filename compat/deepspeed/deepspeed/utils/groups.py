"""`deepspeed.utils.groups`: the tensor- and data-parallel getters, from the groups `initialize` built."""

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

__all__ = [
    "get_data_parallel_group", "get_data_parallel_rank", "get_data_parallel_world_size", "get_model_parallel_group",
    "get_model_parallel_rank", "get_model_parallel_world_size", "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank", "get_tensor_model_parallel_src_rank", "get_tensor_model_parallel_world_size",
]
