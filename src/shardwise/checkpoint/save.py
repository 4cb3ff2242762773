"""Save an engine's checkpoint: every rank writes the pieces it holds, in parallel, atomically.

[Note: atomic checkpoints] Every rank writes its file into `.<tag>.partial/`, fsyncs it and
checksums it; rank 0 gathers every file's size and CRC32 with the piece index into the manifest,
renames the directory to `<tag>`, and only then replaces `latest` (itself by rename). A job killed at
any instant leaves the previous tag intact and `latest` naming a complete checkpoint; a leftover
`.partial` directory is never taken for a checkpoint.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from ..version import __version__
from . import files, layout
from .errors import CheckpointError
from .progress import progress_meta

logger = logging.getLogger(__name__)


class CheckpointWriter:
    """Writes checkpoints, synchronously or (async_save) from one background thread at a time.

    The background thread coordinates on a process group of its own, so its collectives never
    interleave with the training loop's on the main group.
    """

    def __init__(self, async_save: bool, tag_validation: str):
        self.async_save = async_save
        self.tag_validation = tag_validation.lower()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._group: dist.ProcessGroup | None = None

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete; re-raise its error here."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"the background checkpoint save failed: {error}") from error

    def save(self, engine: Any, save_dir: str, tag: str | None, client_state: dict[str, Any], save_latest: bool) -> str:
        self.wait()
        tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
        meta = engine_meta(engine, tag, client_state)  # the same error on every rank, before any collective
        self._validate_tag(tag)
        root = Path(save_dir)
        partial = layout.partial_dir(root, tag)
        if dist.get_rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        dist.barrier()
        with engine.strategy.resident():  # offloaded (NVMe) state is read in for the snapshot
            tensors, records = _pack(engine, include_replicated=engine.topology.data.rank == 0,
                                     include_buffers=dist.get_rank() == 0,
                                     copy=self.async_save or _swapped(engine))
        meta["params_extra"] = {"buffers": [n for n, _ in engine.module.named_buffers()],
                                "persistent_buffers": persistent_buffers(engine.module),
                                "optimizer": _optimizer_meta(engine.optimizer)}
        rng_tensors, meta["rng_json"] = files.rng_state()  # captured now, not when a background write runs
        tensors.update(rng_tensors)
        job = (root, partial, tag, meta, tensors, records, save_latest)
        if not self.async_save:
            _write_and_publish(*job, group=None)
            return str(root / tag)
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        self._thread = threading.Thread(target=self._run, args=job, name="shardwise-checkpoint", daemon=False)
        self._thread.start()
        return str(root / tag)

    def _run(self, *job: Any) -> None:
        try:
            _write_and_publish(*job, group=self._group)
        except BaseException as e:  # noqa: BLE001 - surfaced by wait() on the main thread
            self._error = e

    def _validate_tag(self, tag: str) -> None:
        if self.tag_validation == "ignore":
            return
        tags: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(tags, tag)
        if len(set(tags)) > 1:
            message = f"save_checkpoint: ranks passed different tags {sorted(set(tags))}; pass the same tag on every rank."
            if self.tag_validation == "fail":
                raise CheckpointError(message)
            logger.warning(message)


def save_checkpoint(engine: Any, save_dir: str, tag: str | None, client_state: dict[str, Any], save_latest: bool) -> str:
    writer = engine.checkpoint_writer
    return writer.save(engine, save_dir, tag, client_state, save_latest)


def _write_and_publish(root: Path, partial: Path, tag: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor],
                       records: list[dict], save_latest: bool, group: dist.ProcessGroup | None) -> None:
    rank = dist.get_rank()
    path = partial / layout.rank_file(rank)
    save_file(tensors, str(path), metadata={"rng": meta.pop("rng_json")})
    files.fsync_file(path)
    entry = (path.name, path.stat().st_size, layout.crc32_of(path), records)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, entry, group=group)
    if rank == 0:
        _publish(root, partial, tag, meta, gathered, save_latest)
    dist.barrier(group=group)


def engine_meta(engine: Any, tag: str, client_state: dict[str, Any]) -> dict[str, Any]:
    try:
        json.dumps(client_state)
    except TypeError as e:
        raise CheckpointError(f"client_state: must be JSON-serialisable (checkpoints never pickle); {e}.") from None
    return {
        "format_version": layout.FORMAT_VERSION,
        "shardwise_version": __version__,
        "tag": tag,
        "world_size": dist.get_world_size(),
        "topology": dict(engine.topology.sizes),
        "stage": engine.config.zero_optimization.stage,
        "config": engine.config.model_dump(mode="json"),
        **progress_meta(engine),  # "counters", "data_loader"
        "loss_scaler": engine.precision.loss_scaler.state_dict(),
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "client_state": client_state,
    }


def _elementwise_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, torch.Tensor]:
    state = optimizer.state.get(param, {})
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == param.shape}


def _pack(engine: Any, include_replicated: bool, include_buffers: bool,
          copy: bool) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """This rank's pieces as tensors, and their index records. With `copy` the tensors are
    snapshots in host memory, so training may change the originals while they are written."""
    optimizer = engine.optimizer
    tensors: dict[str, torch.Tensor] = {}
    records = []
    for slot in engine.strategy.state_slots():
        if slot.replicated and not include_replicated:
            continue
        kinds = {layout.MASTER if slot.trainable else layout.VALUE: slot.values}
        if slot.trainable:
            n = slot.end - slot.start
            for key, value in _elementwise_state(optimizer, slot.opt_param).items():
                kinds[f"state.{key}"] = value.view(-1)[slot.opt_offset : slot.opt_offset + n]
        for kind, value in kinds.items():
            tensors[layout.piece_key(slot.name, kind, slot.start)] = _host(value, copy)
        records.append({"name": slot.name, "shape": list(slot.shape), "start": slot.start, "end": slot.end,
                        "trainable": slot.trainable, "dtype": str(slot.values.dtype).removeprefix("torch."),
                        "kinds": sorted(kinds)})
    if include_buffers:
        for name, buf in engine.module.named_buffers():
            tensors[layout.buffer_key(name)] = _host(buf, copy)
    return tensors, records


def _swapped(engine: Any) -> bool:
    """Whether resident() hands out temporary buffers (NVMe): the snapshot must outlive them."""
    offload = getattr(engine.strategy, "offload", None)
    return hasattr(offload, "swapper")


def _host(tensor: torch.Tensor, copy: bool) -> torch.Tensor:
    host = tensor.detach().contiguous().cpu()
    return host.clone() if copy and host.data_ptr() == tensor.data_ptr() else host


def _optimizer_meta(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
              for g in optimizer.param_groups]
    scalars: dict[str, float] = {}
    for state in optimizer.state.values():
        scalars = {k: float(v) for k, v in state.items() if not isinstance(v, torch.Tensor) or v.numel() == 1}
        break
    return {"type": type(optimizer).__name__, "param_groups": groups, "scalars": scalars}


def _publish(root: Path, partial: Path, tag: str, meta: dict[str, Any], gathered: list[Any], save_latest: bool) -> None:
    params: dict[str, dict[str, Any]] = {}
    meta["files"] = {}
    for name, size, crc, records in gathered:
        meta["files"][name] = {"bytes": size, "crc32": crc}
        for r in records:
            entry = params.setdefault(r["name"], {"shape": r["shape"], "dtype": r["dtype"], "trainable": r["trainable"],
                                                  "pieces": []})
            entry["pieces"].append({"file": name, "start": r["start"], "end": r["end"], "kinds": r["kinds"]})
    for name, entry in params.items():
        numel = 1
        for d in entry["shape"]:
            numel *= d
        if not layout.covered(entry["pieces"], numel):
            raise CheckpointError(f"{partial}: the pieces of {name!r} do not cover the whole parameter; not published.")
    meta["params"] = params
    meta.update(meta.pop("params_extra"))
    files.write_durably(partial / layout.MANIFEST, json.dumps(meta, indent=1).encode())
    files.fsync_dir(partial)
    final = root / tag
    if final.exists():  # re-saving a tag: the old one goes only once the new one is complete
        replaced = root / f".{tag}.replaced"
        shutil.rmtree(replaced, ignore_errors=True)
        final.rename(replaced)
        partial.rename(final)
        shutil.rmtree(replaced)
    else:
        partial.rename(final)
    files.fsync_dir(root)
    if save_latest:
        files.write_durably(root / layout.LATEST, tag.encode())


def persistent_buffers(module: torch.nn.Module) -> list[str]:
    """Buffers that belong in a state dict (not those registered with persistent=False)."""
    names = []
    for prefix, mod in module.named_modules():
        for name, buf in mod.named_buffers(recurse=False):
            if buf is not None and name not in mod._non_persistent_buffers_set:
                names.append(f"{prefix}.{name}" if prefix else name)
    return names
