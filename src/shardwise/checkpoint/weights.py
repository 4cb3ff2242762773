"""Consolidated weights: the whole state dict on rank 0 (DeepSpeed's `_zero3_consolidated_16bit_state_dict`,
which Hugging Face's Trainer and accelerate call) and the 16-bit safetensors file for inference or
`from_pretrained` written from it."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import save_file

from ..protocols import TrainingEngine
from ..tensor_parallel.shard import assemble
from . import files
from .errors import CheckpointError

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


def consolidated_state_dict(engine: TrainingEngine, exclude_frozen: bool = False) -> dict[str, torch.Tensor] | None:
    """ZeRO-3's whole weights, in the training dtype on CPU, on rank 0; None on the other ranks.

    A collective: every rank must call it. Keys are those of `module.state_dict()`; a tied parameter appears
    under each of its names as one tensor, as DeepSpeed returns it.
    """
    stage = engine.config.zero_optimization.stage
    if stage != 3:  # DeepSpeed's rule for this name: it is ZeRO-3's gather
        raise ValueError(f"_zero3_consolidated_16bit_state_dict: requires ZeRO stage 3; got stage {stage}. Below "
                         "stage 3 every rank holds whole weights: use engine.module.state_dict().")
    return whole_weights(engine, exclude_frozen)


def whole_weights(engine: TrainingEngine, exclude_frozen: bool = False) -> dict[str, torch.Tensor] | None:
    """The whole model's weights in the training dtype on global rank 0 (None elsewhere), under any layout:
    DeepSpeed's `_consolidated_16bit_state_dict`. A collective: every rank calls it."""
    if not engine.tensor_shards:
        return engine.strategy.consolidated_state_dict(exclude_frozen)
    if engine.config.zero_optimization.stage == 3:
        raise CheckpointError("save_16bit_model: whole weights of a tensor-parallel model at ZeRO stage 3 are not "
                              "gathered in memory; save a checkpoint (engine.save_checkpoint) and run `shardwise "
                              "checkpoint to-fp32 <save_dir> <out_dir>`, which reassembles every split parameter by name.")
    return _gather_tensor_parallel(engine, exclude_frozen)


def _gather_tensor_parallel(engine: TrainingEngine, exclude_frozen: bool) -> dict[str, torch.Tensor] | None:
    """Each split parameter gathered over its tensor-parallel group (parameters are whole over data-parallel ranks
    below stage 3), assembled on global rank 0 under every name it has (tied weights)."""
    group, shards = engine.topology.tensor, engine.tensor_shards
    params = dict(engine.module.named_parameters())
    whole: dict[int, torch.Tensor] = {}
    for name in sorted(shards):  # the same order on every rank
        local = params[name].detach().contiguous()
        flat = torch.empty(group.size * local.numel(), dtype=local.dtype, device=local.device)
        engine.comm.all_gather(flat, local.view(-1), group).wait()
        whole[id(params[name])] = assemble(list(flat.view(group.size, *local.shape).unbind(0)), shards[name].dim,
                                           shards[name].blocks)
    if dist.get_rank() != 0:
        return None
    frozen = {n for n, p in engine.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    state = {k: v for k, v in engine.module.state_dict().items() if not (exclude_frozen and k in frozen)}
    for name, param in engine.module.named_parameters(remove_duplicate=False):
        if name in state and id(param) in whole:
            state[name] = whole[id(param)]
    return state


def refuse_placeholders(state: dict[str, torch.Tensor], module: torch.nn.Module) -> None:
    """A save never writes a partitioned parameter's empty placeholder: raise if `state` holds one."""
    params = dict(module.named_parameters(remove_duplicate=False))
    empty = [name for name, t in state.items()
             if t.numel() == 0 and name in params and getattr(params[name], "ds_numel", params[name].numel()) > 0]
    if empty:
        raise CheckpointError(f"save: {len(empty)} tensors are ZeRO-3 placeholders of partitioned parameters "
                              f"({', '.join(empty[:3])}{' ...' if len(empty) > 3 else ''}); got empty tensors where "
                              "the model has whole ones. Take the state dict from "
                              "engine._zero3_consolidated_16bit_state_dict() called on every rank.")


def save_16bit_model(engine: TrainingEngine, save_dir: str, save_filename: str, exclude_frozen: bool = False) -> str | None:
    """Consolidated weights in the training dtype, as one safetensors file written by rank 0.

    Every rank must call it. At stage 3 this gathers the model one module at a time, so it runs only when
    `stage3_gather_16bit_weights_on_model_save` is set (DeepSpeed's rule); otherwise it says so and
    returns None.
    """
    zero = engine.config.zero_optimization
    if zero.stage == 3 and not zero.stage3_gather_16bit_weights_on_model_save:
        logger.warning("save_16bit_model: nothing saved; at ZeRO stage 3 set "
                       "zero_optimization.stage3_gather_16bit_weights_on_model_save to true (it gathers the whole "
                       "model on every rank), or use save_checkpoint, whose shards any layout can load.")
        return None
    state = whole_weights(engine, exclude_frozen)
    path = Path(save_dir) / save_filename
    # Rank 0 writes alone; the others wait for its outcome, so its failure (a full disk) ends every rank with
    # the same error instead of leaving them in a barrier that rank 0 never reaches.
    box = [_write(state, path, engine.module) if state is not None else None]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise CheckpointError(f"save_16bit_model: rank 0 could not write the weights: {box[0]}")
    return str(path)


def _write(state: dict[str, torch.Tensor], path: Path, module: torch.nn.Module) -> str | None:
    """Write `state` to `path` through a temporary file (removed on failure); what went wrong, or None."""
    tmp = path.with_name(f".{path.name}.partial")
    try:
        refuse_placeholders(state, module)
        tensors = _untie({k: v.detach().contiguous().cpu() for k, v in state.items()})
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp))
        files.fsync_file(tmp)
        os.replace(tmp, path)
        return None
    except CheckpointError as e:
        return str(e)
    except (OSError, SafetensorError) as e:
        files.remove_quietly(tmp)
        return files.write_error(path, e, sum(t.numel() * t.element_size() for t in tensors.values()))
    except Exception as e:  # noqa: BLE001 - every rank raises it (save_16bit_model)
        files.remove_quietly(tmp)
        return f"{path}: {type(e).__name__}: {e}"
