"""Checkpoints: safetensors + a JSON manifest, written atomically by every rank, loadable at any layout.

DeepSpeed's checkpoints too (the `deepspeed_*` modules): read at any layout as if shardwise had written them
(ZeRO 0-3 folders, universal folders), written in its layout for DeepSpeed to resume (`checkpoint.format:
"deepspeed"`, `shardwise checkpoint export`), and converted (`shardwise checkpoint import`)."""

from .errors import CheckpointError
from .load import load_checkpoint
from .reader import CheckpointReader
from .save import save_checkpoint
from .weights import save_16bit_model

__all__ = ["CheckpointError", "CheckpointReader", "load_checkpoint", "save_16bit_model", "save_checkpoint"]
