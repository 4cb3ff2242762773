"""`deepspeed.runtime.data_pipeline.data_routing.helper`: `convert_to_random_ltd(engine, LayerClass)` (DeepSpeed-Chat
calls it after initialize) and the state-dict helpers, which have nothing to strip in shardwise (random-LTD adds
no name level)."""

from shardwise.data_efficiency.random_ltd import (
    convert_to_random_ltd,
    remove_random_ltd_state_dict,
    save_without_random_ltd,
)

__all__ = ["convert_to_random_ltd", "remove_random_ltd_state_dict", "save_without_random_ltd"]
