"""Checkpoints: safetensors + a JSON manifest, written atomically, loaded without unpickling."""

from .io import CheckpointError, load_checkpoint, read_manifest, save_16bit_model, save_checkpoint

__all__ = ["CheckpointError", "load_checkpoint", "read_manifest", "save_16bit_model", "save_checkpoint"]
