"""`deepspeed.checkpointing` (activation checkpointing): shardwise.runtime.activation_checkpointing."""

from shardwise.runtime.activation_checkpointing import checkpoint, configure, is_configured, reset

__all__ = ["checkpoint", "configure", "is_configured", "reset"]
