"""`deepspeed.checkpointing`: activation checkpointing (shardwise.runtime.activation_checkpointing)."""

from .runtime.activation_checkpointing.checkpointing import *  # noqa: F401,F403
from .runtime.activation_checkpointing.checkpointing import __all__  # noqa: F401
