"""`deepspeed.runtime.tensor_parallel`: `tp_model_init` (AutoTP training), shardwise's tensor parallelism."""

from shardwise.tensor_parallel.megatron import tp_model_init

__all__ = ["tp_model_init"]
