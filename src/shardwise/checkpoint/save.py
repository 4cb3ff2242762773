"""Save an engine's checkpoint: every rank writes the pieces it holds, in parallel, atomically.

[Note: atomic checkpoints] Every rank writes its file into `.<tag>.partial/`, fsyncs it and
checksums it; rank 0 gathers every file's size and CRC32 with the piece index into the manifest,
renames the directory to `<tag>`, and only then replaces `latest` (itself by rename). A job killed at
any instant leaves the previous tag intact and `latest` naming a complete checkpoint; a leftover
`.partial` directory is never taken for a checkpoint. A rank whose write fails (a full disk) still
joins the exchange, so every rank raises the same error, rank 0 removes the partial directory, and
`latest` keeps naming the last complete tag.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import save_file

from ..protocols import TrainingEngine
from ..version import __version__
from . import files, layout
from .errors import CheckpointError
from .progress import progress_meta


@dataclass
class SaveJob:
    """What one rank writes for one tag: captured at the call, written now or by the background writer."""

    root: Path
    tag: str
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    records: list[dict]
    buffers: list[tuple[str, bool]]
    """(name, persistent) of the buffers in this rank's file: the first data-parallel replica of each pipeline
    stage writes its stage's buffers."""
    rng_json: str
    save_latest: bool

    @property
    def partial(self) -> Path:
        return layout.partial_dir(self.root, self.tag)


def save_checkpoint(engine: TrainingEngine, save_dir: str, tag: str | None, client_state: dict[str, Any], save_latest: bool,
                    exclude_frozen_parameters: bool = False) -> str:
    """Save `engine` to `save_dir/<tag>/` (tag default: global_step<N>) and point `save_dir/latest` at it.

    A tag is one directory name of ASCII letters, digits and `. _ - + = @`, not starting with '.', at
    most 200 characters, and not `latest`; anything else (a path such as "../x", "", "a/b", a NUL or
    newline) is refused on every rank before anything is written. Every rank must pass the same tag: ranks
    that differ are refused on every rank, naming each rank's tag, whatever `checkpoint.tag_validation`
    says, except "Ignore", which saves under rank 0's tag. Nothing outside `save_dir` is written or removed,
    and an existing `save_dir/<tag>` is replaced only if it is a shardwise checkpoint.

    `exclude_frozen_parameters` leaves out parameters that do not train (a LoRA fine-tune's base model, which
    is most of the bytes): such a checkpoint loads with `load_module_strict=False`, the frozen parameters
    keeping the values the model was built with, as in DeepSpeed.
    """
    if engine.config.checkpoint.format == "deepspeed":
        from .deepspeed_save import save_in_deepspeed_layout

        return save_in_deepspeed_layout(engine, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
    return engine.checkpoint_writer.save(engine, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)


def pack_job(engine: TrainingEngine, root: Path, tag: str, client_state: dict[str, Any], save_latest: bool, copy: bool,
             exclude_frozen: bool = False) -> SaveJob:
    """This rank's share of the checkpoint, in host memory (copies when `copy`: the write may run later)."""
    meta = engine_meta(engine, tag, client_state)
    meta["frozen_parameters_excluded"] = exclude_frozen
    first_replica = engine.topology.data.rank == 0
    with engine.strategy.resident():  # offloaded (NVMe) state is read in for the snapshot
        tensors, records = _pack(engine, include_buffers=first_replica,
                                 copy=copy or engine.strategy.swaps_to_disk, include_frozen=not exclude_frozen)
    persistent = set(persistent_buffers(engine.module))
    buffers = [(n, n in persistent) for n, _ in engine.module.named_buffers()] if first_replica else []
    meta["params_extra"] = {"optimizer": {**_optimizer_meta(engine.optimizer),
                                          "groups": getattr(engine, "param_group_names", None)},
                            "shared_params": shared_params(engine.module)}
    rng_tensors, rng_json = files.rng_state()  # captured now, not when a background write runs
    tensors.update(rng_tensors)
    local = engine.strategy.rank_local_state()
    tensors.update({layout.RANK_LOCAL + k: v.detach().to("cpu", copy=True) for k, v in local.items()})
    return SaveJob(root, tag, meta, tensors, records, buffers, rng_json, save_latest)


def prepare(root: Path, tag: str) -> None:
    """Rank 0 creates `.<tag>.partial/`; every rank then raises the same error if it could not."""
    problem = None
    if dist.get_rank() == 0:
        partial = layout.partial_dir(root, tag)
        try:
            _check_replaceable(root / tag)
            root.mkdir(parents=True, exist_ok=True)
            _remove(partial)
            partial.mkdir()
        except CheckpointError as e:
            problem = str(e)
        except OSError as e:
            problem = f"save_checkpoint: {files.write_error(Path(e.filename or partial), e)}"
    box = [problem]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise CheckpointError(box[0])


def write_and_publish(job: SaveJob, group: dist.ProcessGroup | None) -> None:
    """Every rank writes its file; rank 0 publishes the tag if every rank succeeded, else removes the
    partial directory. Every rank raises the same error on failure (no rank is left waiting for another)."""
    rank = dist.get_rank()
    try:
        entry: tuple[str, Any] = ("ok", _write_rank_file(job, rank))
    except Exception as e:  # noqa: BLE001 - reported to every rank through the exchange below
        entry = ("error", f"rank {rank}: {e}")
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, entry, group=group)
    box = [_publish_or_discard(job, gathered) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    if box[0] is not None:
        raise CheckpointError(box[0])


def _write_rank_file(job: SaveJob, rank: int) -> tuple[str, int, str, list[dict], list[tuple[str, bool]]]:
    path = job.partial / layout.rank_file(rank)
    try:
        save_file(job.tensors, str(path), metadata={"rng": job.rng_json})
        files.fsync_file(path)
        return path.name, path.stat().st_size, layout.crc32_of(path), job.records, job.buffers
    except (OSError, SafetensorError) as e:
        # the data, the RNG metadata and ~128 header bytes per tensor: what this file takes
        needed = sum(t.numel() * t.element_size() for t in job.tensors.values()) + len(job.rng_json) + 128 * len(job.tensors)
        raise CheckpointError(files.write_error(path, e, needed)) from e


def _publish_or_discard(job: SaveJob, gathered: list[tuple[str, Any]]) -> str | None:
    """Rank 0: publish the tag, or say why not (None when published)."""
    try:
        errors = [message for status, message in gathered if status == "error"]
        if errors:
            raise CheckpointError(" ".join(errors))  # each is a sentence naming its rank and file
        _publish(job, [value for _, value in gathered])
    except Exception as e:  # noqa: BLE001 - every rank raises this message
        shutil.rmtree(job.partial, ignore_errors=True)  # never taken for a checkpoint, but never left either
        return f"save_checkpoint: tag {job.tag!r} in {job.root} was not saved: {e} `latest` names {_latest(job.root)}."
    if job.save_latest:
        try:
            files.write_durably(job.root / layout.LATEST, job.tag.encode())
        except CheckpointError as e:
            return (f"save_checkpoint: {job.root / job.tag} is complete, but `latest` could not be updated: {e} "
                    f"It still names {_latest(job.root)}.")
    return None


def _latest(root: Path) -> str:
    latest = root / layout.LATEST
    return repr(latest.read_bytes().decode(errors="replace")) if latest.is_file() else "no tag (there is none)"


def engine_meta(engine: TrainingEngine, tag: str, client_state: dict[str, Any]) -> dict[str, Any]:
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


def _pack(engine: TrainingEngine, include_buffers: bool, copy: bool,
          include_frozen: bool = True) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """This rank's pieces as tensors, and their index records. With `copy` the tensors are
    snapshots in host memory, so training may change the originals while they are written."""
    optimizer = engine.optimizer
    tensors: dict[str, torch.Tensor] = {}
    records = []
    shards, tensor_rank = engine.tensor_shards, engine.topology.tensor.rank
    for slot in engine.strategy.state_slots():
        if slot.replica != 0 or (not slot.trainable and not include_frozen):
            continue
        shard = shards.get(slot.name)
        if shard is None and tensor_rank != 0:  # whole on every tensor-parallel rank: rank 0 writes it
            continue
        kinds = {layout.MASTER if slot.trainable else layout.VALUE: slot.values}
        if slot.trainable:
            n = slot.end - slot.start
            for key, value in _elementwise_state(optimizer, slot.opt_param).items():
                kinds[f"state.{key}"] = value.view(-1)[slot.opt_offset : slot.opt_offset + n]
        part = shard.rank if shard is not None else None
        for kind, value in kinds.items():
            tensors[layout.piece_key(slot.name, kind, slot.start, part)] = _host(value, copy)
        record = {"name": slot.name, "shape": list(shard.full_shape if shard else slot.shape), "start": slot.start,
                  "end": slot.end, "trainable": slot.trainable, "dtype": str(slot.values.dtype).removeprefix("torch."),
                  "kinds": sorted(kinds)}
        if shard is not None:
            record.update(part=part, tp=shard.describe())
        records.append(record)
    if include_buffers:
        for name, buf in engine.module.named_buffers():
            tensors[layout.buffer_key(name)] = _host(buf, copy)
    return tensors, records


def _host(tensor: torch.Tensor, copy: bool) -> torch.Tensor:
    host = tensor.detach().contiguous().cpu()
    return host.clone() if copy and host.data_ptr() == tensor.data_ptr() else host


def shared_params(module: torch.nn.Module) -> dict[str, str]:
    """Tied weights: each further name a parameter has in the state dict -> its first name (what DeepSpeed's
    `shared_params` records, and what an exported checkpoint's module state dict must hold again)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def _optimizer_meta(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
              for g in optimizer.param_groups]
    return {"type": type(optimizer).__name__, "param_groups": groups, "scalars": _scalars(optimizer)}


def _scalars(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """The numbers every parameter's state shares (Adam's step), read from the largest parameter's state: a
    one-element parameter's moments are one element too and would pass for scalars, which the loader gives to
    every parameter. (A 0-d parameter's step has its shape: it is saved with its moments, element-wise.)"""
    states = [(p, s) for p, s in optimizer.state.items() if isinstance(p, torch.Tensor)]
    if not states:
        return {}
    param, state = max(states, key=lambda item: (item[0].numel(), item[0].dim()))
    return {k: float(v) for k, v in state.items()
            if not isinstance(v, torch.Tensor) or (v.numel() == 1 and v.shape != param.shape)}


def _publish(job: SaveJob, gathered: list[Any]) -> None:
    """Rank 0: write the manifest from every rank's file entry and rename the tag into place."""
    meta, partial = job.meta, job.partial
    params: dict[str, dict[str, Any]] = {}
    meta["files"], buffer_files, persistent = {}, {}, []
    for name, size, crc, records, buffers in gathered:
        meta["files"][name] = {"bytes": size, "crc32": crc}
        for buffer, is_persistent in buffers:
            if buffer not in buffer_files:
                buffer_files[buffer] = name
                persistent += [buffer] if is_persistent else []
        for r in records:
            entry = params.setdefault(r["name"], {"shape": r["shape"], "dtype": r["dtype"], "trainable": r["trainable"],
                                                  "pieces": [], **({"tp": r["tp"]} if "tp" in r else {})})
            piece = {"file": name, "start": r["start"], "end": r["end"], "kinds": r["kinds"]}
            entry["pieces"].append(piece if "part" not in r else {**piece, "part": r["part"]})
    for name, entry in params.items():
        if not layout.covered_parts(entry):
            raise CheckpointError(f"{partial}: the pieces of {name!r} do not cover the whole parameter; not published.")
    meta["params"] = params
    meta.update(meta.pop("params_extra"))
    meta["buffers"], meta["persistent_buffers"], meta["buffer_files"] = list(buffer_files), persistent, buffer_files
    files.write_durably(partial / layout.MANIFEST, json.dumps(meta, indent=1).encode())
    files.fsync_dir(partial)
    _replace(partial, job.root / job.tag)
    files.fsync_dir(job.root)


def _replace(partial: Path, final: Path) -> None:
    """Rename `partial` to `final`; an existing checkpoint there goes only once the new one is in place."""
    _check_replaceable(final)
    if not final.exists():
        partial.rename(final)
        return
    replaced = final.with_name(f".{final.name}.replaced")
    _remove(replaced)
    final.rename(replaced)
    try:
        partial.rename(final)
    except OSError:
        replaced.rename(final)
        raise
    shutil.rmtree(replaced)


def _check_replaceable(final: Path) -> None:
    """Only a shardwise checkpoint directory is ever replaced: never a link, a file or another directory."""
    if final.is_symlink() or (final.exists() and not (final.is_dir() and (final / layout.MANIFEST).is_file())):
        raise CheckpointError(f"save_checkpoint: {final} exists and is not a shardwise checkpoint, so it is left "
                              "alone; choose another tag or save_dir.")


def _remove(path: Path) -> None:
    """Remove a leftover temporary (`.<tag>.partial` or `.replaced`): a link itself, never what it points to."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def persistent_buffers(module: torch.nn.Module) -> list[str]:
    """Buffers that belong in a state dict (not those registered with persistent=False)."""
    names = []
    for prefix, mod in module.named_modules():
        for name, buf in mod.named_buffers(recurse=False):
            if buf is not None and name not in mod._non_persistent_buffers_set:
                names.append(f"{prefix}.{name}" if prefix else name)
    return names
