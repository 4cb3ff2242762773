"""`deepspeed.runtime.sequence_parallel.parallel_state_sp`: the sequence-parallel groups (the mpu)."""

from shardwise.sequence_parallel.mpu import (
    get_model_parallel_group,
    get_model_parallel_rank,
    get_model_parallel_world_size,
    get_sequence_data_parallel_group,
    get_sequence_data_parallel_rank,
    get_sequence_data_parallel_world_size,
    get_sequence_parallel_group,
    get_sequence_parallel_rank,
    get_sequence_parallel_world_size,
    initialize_sequence_parallel,
)

__all__ = [
    "get_model_parallel_group", "get_model_parallel_rank", "get_model_parallel_world_size",
    "get_sequence_data_parallel_group", "get_sequence_data_parallel_rank", "get_sequence_data_parallel_world_size",
    "get_sequence_parallel_group", "get_sequence_parallel_rank", "get_sequence_parallel_world_size",
    "initialize_sequence_parallel",
]
