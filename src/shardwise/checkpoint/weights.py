"""Consolidated 16-bit weights for inference or `from_pretrained` (one safetensors file)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist
from safetensors.torch import save_file

logger = logging.getLogger(__name__)


def _untie(tensors: dict) -> dict:
    """safetensors refuses shared storage: tied weights are saved once per name, as copies."""
    seen: set[int] = set()
    out = {}
    for name, t in tensors.items():
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out


def save_16bit_model(engine: Any, save_dir: str, save_filename: str) -> str | None:
    """Consolidated weights in the training dtype, as one safetensors file written by rank 0.

    At stage 3 this gathers every parameter on every rank, so it runs only when
    `stage3_gather_16bit_weights_on_model_save` is set (DeepSpeed's rule); otherwise it says so and
    returns None.
    """
    zero = engine.config.zero_optimization
    if zero.stage == 3 and not zero.stage3_gather_16bit_weights_on_model_save:
        logger.warning("save_16bit_model: nothing saved; at ZeRO stage 3 set "
                       "zero_optimization.stage3_gather_16bit_weights_on_model_save to true (it gathers the whole "
                       "model on every rank), or use save_checkpoint, whose shards any layout can load.")
        return None
    state = engine.module.state_dict()
    path = Path(save_dir) / save_filename
    if dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.partial")
        save_file(_untie({k: v.detach().contiguous().cpu() for k, v in state.items()}), str(tmp))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    dist.barrier()
    return str(path)
