"""`deepspeed.module_inject.layers`: `set_autotp_mode` (shardwise splits at initialize; nothing to switch)."""

from shardwise.tensor_parallel.megatron import set_autotp_mode

__all__ = ["set_autotp_mode"]
