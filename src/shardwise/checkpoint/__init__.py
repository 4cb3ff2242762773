"""Checkpoints: safetensors + a JSON manifest, written atomically by every rank, loadable at any layout."""

from .errors import CheckpointError
from .load import load_checkpoint
from .reader import CheckpointReader
from .save import save_checkpoint
from .weights import save_16bit_model

__all__ = ["CheckpointError", "CheckpointReader", "load_checkpoint", "save_16bit_model", "save_checkpoint"]
