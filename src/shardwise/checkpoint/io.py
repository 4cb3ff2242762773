"""Save and load an engine's checkpoint: safetensors + a JSON manifest, written atomically.

[Note: atomic checkpoints] Every rank writes into `.<tag>.partial/` and fsyncs; after a barrier
rank 0 records sizes and checksums in the manifest, renames the directory to `<tag>` and only then
replaces `latest` (itself via a temporary file and rename). A job killed at any instant leaves the
previous tag intact and `latest` pointing at a complete checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from ..version import __version__
from . import layout

logger = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt or incompatible; the message names the file."""


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    state["numpy"] = [state["numpy"][0], state["numpy"][1].tolist(), *state["numpy"][2:]]
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _rank_state(engine: Any) -> dict[str, Any]:
    return {"strategy": engine.strategy.state_dict(), "rng": _rng_state()}


def _engine_meta(engine: Any, tag: str, client_state: dict[str, Any]) -> dict[str, Any]:
    try:
        json.dumps(client_state)
    except TypeError as e:
        raise CheckpointError(f"client_state: must be JSON-serialisable (nothing is pickled); {e}") from None
    sched = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    return {
        "format_version": layout.FORMAT_VERSION,
        "shardwise_version": __version__,
        "tag": tag,
        "world_size": engine.world_size,
        "stage": engine.config.zero_optimization.stage,
        "config": engine.config.model_dump(mode="json"),
        "counters": {k: getattr(engine, k) for k in ("global_steps", "global_samples", "skipped_steps", "micro_steps")},
        "loss_scaler": engine.precision.loss_scaler.state_dict(),
        "lr_scheduler": sched,
        "client_state": client_state,
    }


def save_checkpoint(engine: Any, save_dir: str, tag: str | None, client_state: dict[str, Any], save_latest: bool) -> str:
    tag = tag or f"global_step{engine.global_steps}"
    root = Path(save_dir)
    partial = layout.partial_dir(root, tag)
    rank = dist.get_rank()
    meta = _engine_meta(engine, tag, client_state)
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    tree, tensors = layout.split_tensors(_rank_state(engine))
    save_file(tensors, str(partial / layout.state_file(rank)), metadata={"tree": json.dumps(tree)})
    module_state = engine.module.state_dict()  # every rank: at stage 3 this gathers the shards
    if rank == 0:
        model = {k: v.detach().contiguous().cpu() for k, v in module_state.items()}
        save_file(_untie(model), str(partial / layout.MODEL_FILE))
    del module_state
    _fsync_dir_files(partial, rank)
    dist.barrier()
    if rank == 0:
        _publish(root, partial, tag, meta, save_latest)
    dist.barrier()
    return str(root / tag)


def _untie(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses shared storage: tied weights are saved once per name, as copies."""
    seen: set[int] = set()
    out = {}
    for name, t in tensors.items():
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out


def _fsync_dir_files(directory: Path, rank: int) -> None:
    for path in directory.iterdir():
        if path.name.startswith(f"state.rank{rank}.") or (rank == 0 and path.name == layout.MODEL_FILE):
            with open(path, "rb") as f:
                os.fsync(f.fileno())


def _publish(root: Path, partial: Path, tag: str, meta: dict[str, Any], save_latest: bool) -> None:
    meta["files"] = {p.name: {"bytes": p.stat().st_size, "sha256": layout.sha256_of(p)} for p in sorted(partial.iterdir())}
    _fsync_write(partial / layout.MANIFEST, json.dumps(meta, indent=1).encode())
    final = root / tag
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)
    if save_latest:
        tmp = root / f".{layout.LATEST}.tmp"
        _fsync_write(tmp, tag.encode())
        os.replace(tmp, root / layout.LATEST)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(load_dir: str, tag: str | None) -> tuple[Path, dict[str, Any]]:
    root = Path(load_dir)
    if tag is None:
        latest = root / layout.LATEST
        if not latest.is_file():
            raise CheckpointError(f"{latest}: no 'latest' file; pass tag= or point load_dir at a checkpoint directory.")
        tag = latest.read_text().strip()
    path = root / tag
    manifest = path / layout.MANIFEST
    if not manifest.is_file():
        raise CheckpointError(f"{manifest}: missing; {path} is not a complete shardwise checkpoint.")
    meta = json.loads(manifest.read_text())
    if meta.get("format_version") != layout.FORMAT_VERSION:
        raise CheckpointError(f"{manifest}: format_version {meta.get('format_version')} is not {layout.FORMAT_VERSION}; "
                              "it was written by an incompatible shardwise version.")
    return path, meta


def _verified(path: Path, meta: dict[str, Any]) -> Path:
    expected = meta["files"].get(path.name)
    if expected is None or not path.is_file():
        raise CheckpointError(f"{path}: missing from the checkpoint.")
    if path.stat().st_size != expected["bytes"] or layout.sha256_of(path) != expected["sha256"]:
        raise CheckpointError(f"{path}: size or checksum differs from the manifest; the file is corrupt or truncated.")
    return path


def load_checkpoint(engine: Any, load_dir: str, tag: str | None, load_module_strict: bool,
                    load_optimizer_states: bool, load_lr_scheduler_states: bool) -> tuple[str, dict[str, Any]]:
    path, meta = read_manifest(load_dir, tag)
    if meta["world_size"] != engine.world_size or meta["stage"] != engine.config.zero_optimization.stage:
        raise CheckpointError(f"{path}: saved at world size {meta['world_size']} stage {meta['stage']}; loading at a "
                              "different world size or stage is not available yet.")
    weights = load_file(str(_verified(path / layout.MODEL_FILE, meta)))
    engine.strategy.load_module_state_dict(weights, strict=load_module_strict)
    rank_file = _verified(path / layout.state_file(dist.get_rank()), meta)
    from safetensors import safe_open

    with safe_open(str(rank_file), "pt") as f:
        tree = json.loads(f.metadata()["tree"])
    state = layout.join_tensors(tree, load_file(str(rank_file)))
    if load_optimizer_states:
        engine.strategy.load_state_dict(state["strategy"])
        engine.precision.loss_scaler.load_state_dict(meta["loss_scaler"])
        for key, value in meta["counters"].items():
            setattr(engine, key, value)
        _set_rng_state(state["rng"])
    if load_lr_scheduler_states and engine.lr_scheduler is not None and meta["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    return str(path), meta["client_state"]


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
