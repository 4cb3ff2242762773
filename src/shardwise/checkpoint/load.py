"""Load a checkpoint into an engine of any layout: by parameter name, slice by slice.

Each rank reads only the element ranges it holds now (`strategy.state_slots()`), from whichever
files the saving ranks wrote them to, so a checkpoint saved at world size N and ZeRO stage S loads at
world size M and stage S'.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..protocols import StateSlot, TrainingEngine
from ..tensor_parallel.shard import TensorShard
from . import files, layout
from .errors import CheckpointError
from .progress import restore_progress
from .reader import open_checkpoint

if TYPE_CHECKING:
    from .reader import AnyReader

logger = logging.getLogger(__name__)


def load_checkpoint(engine: TrainingEngine, load_dir: str, tag: str | None, load_module_strict: bool,
                    load_optimizer_states: bool, load_lr_scheduler_states: bool) -> tuple[str, dict[str, Any]]:
    reader = open_checkpoint(load_dir, tag)
    meta = reader.meta
    model = _model_names(engine.module)
    if meta.get("origin") == "deepspeed":
        _check_deepspeed(reader, engine, load_optimizer_states, model)
    with engine.strategy.resident(), torch.no_grad():
        slots = engine.strategy.state_slots()
        _check_names(reader, model, load_module_strict)
        shards = engine.tensor_shards
        _check_shapes(reader, slots, engine.module, shards)
        for slot in slots:
            if reader.has(slot.name):
                kind = layout.MASTER if layout.MASTER in reader.kinds(slot.name) else layout.VALUE
                reader.read_into(slot.name, kind, slot.start, slot.end, slot.values, shards.get(slot.name))
        for name, buf in engine.module.named_buffers():
            if name in meta["buffers"]:
                buf.copy_(reader.buffer(name))
        if load_optimizer_states:
            _load_optimizer(engine.optimizer, slots, reader, shards)
            _load_rank_local(engine, reader)
        engine.strategy.after_state_load()
    if load_optimizer_states:
        engine.precision.loss_scaler.load_state_dict(meta["loss_scaler"])
        restore_progress(engine, meta)
        _restore_rng(reader, meta)
    if load_lr_scheduler_states and engine.lr_scheduler is not None and meta["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    dist.barrier()
    return str(reader.path), meta["client_state"]


def _check_deepspeed(reader: AnyReader, engine: TrainingEngine, load_optimizer_states: bool,
                     model: dict[str, bool]) -> None:
    """Place a stage-0 checkpoint's optimizer state by this engine's groups; refuse, before anything is loaded,
    what a DeepSpeed checkpoint cannot give this engine."""
    meta = reader.meta
    if load_optimizer_states and meta["stage"] == 0 and not getattr(reader, "bound", True):
        from .deepspeed_stage0 import bind_stage0

        groups = getattr(engine, "param_group_names", None)
        if groups is None:
            raise CheckpointError(f"{reader.path}: a stage-0 DeepSpeed checkpoint records its optimizer state by "
                                  "position in the optimizer's groups, which this engine does not record; pass "
                                  "load_optimizer_states=False to load the weights only.")
        bind_stage0(reader, groups, model)
    if load_optimizer_states and engine.optimizer is not None:
        kinds = {k.removeprefix("state.") for n in meta["params"] if reader.has(n) for k in reader.kinds(n)
                 if k.startswith("state.")}
        wants = _STATE_KEYS.get(type(engine.optimizer).__name__)
        if kinds and wants is not None and not kinds <= wants:
            raise CheckpointError(
                f"{reader.path}: DeepSpeed's optimizer ({meta['optimizer']['deepspeed_type'] or 'a client optimizer'}) "
                f"kept {sorted(kinds)} for each parameter; this engine's {type(engine.optimizer).__name__} keeps "
                f"{sorted(wants)}. Configure the same optimizer as the saving run, or pass load_optimizer_states=False.")


# The element-wise state each of shardwise's optimizers keeps, to check a DeepSpeed checkpoint's against.
_STATE_KEYS = {name: {"exp_avg", "exp_avg_sq"} for name in ("AdamW", "Adam", "FusedAdam", "CPUAdam", "_AdamWithMode",
                                                              "FusedLamb", "Lamb", "DeepSpeedCPUAdam")}
_STATE_KEYS.update({"SGD": {"momentum_buffer"}, "Lion": {"exp_avg"}, "FusedLion": {"exp_avg"}, "CPUAdagrad": {"sum"},
                    "Adagrad": {"sum"}})


def _model_names(module: torch.nn.Module) -> dict[str, bool]:
    """The whole model's parameter names, each with whether it trains: every rank's, since a pipeline stage
    holds only its own layers."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted((n, p.requires_grad) for n, p in module.named_parameters()))
    trains: dict[str, bool] = {}
    for names in gathered:
        for name, requires_grad in names:
            trains[name] = trains.get(name, False) or requires_grad
    return trains


def _check_names(reader: AnyReader, model: dict[str, bool], strict: bool) -> None:
    saved = set(reader.meta["params"])
    missing, unexpected = sorted(set(model) - saved), sorted(saved - set(model))
    if strict and (missing or unexpected):
        why = (" It was saved with exclude_frozen_parameters=True, so its frozen parameters are not in it."
               if reader.meta.get("frozen_parameters_excluded") else "")
        raise CheckpointError(
            f"{reader.path}: parameters do not match the model (load_module_strict=True). Missing from the "
            f"checkpoint: {missing[:20]}; in the checkpoint but not the model: {unexpected[:20]}.{why} Pass "
            "load_module_strict=False to load the matching ones.")
    if dist.get_rank() != 0:  # every rank has the whole model's names: one report for the job
        return
    # A checkpoint saved with exclude_frozen_parameters=True (Hugging Face's Trainer asks for it with a peft
    # model) leaves out exactly the frozen parameters: their absence is the design, not a loss worth a warning.
    by_design = [n for n in missing if not model[n]] if reader.meta.get("frozen_parameters_excluded") else []
    missing = [n for n in missing if n not in set(by_design)]
    if by_design:
        count = f"{len(by_design)} frozen parameters were" if len(by_design) > 1 else "1 frozen parameter was"
        logger.info("load_checkpoint: %s left out of the checkpoint by design (saved with "
                    "exclude_frozen_parameters=True) and keep their loaded values.", count)
    if missing:
        more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
        logger.warning("load_checkpoint: parameters not in the checkpoint keep their values: %s%s", missing[:20], more)


def _check_shapes(reader: AnyReader, slots: list[StateSlot], module: torch.nn.Module,
                  shards: dict[str, TensorShard]) -> None:
    """Refuse, on every rank alike, any parameter or buffer whose saved shape differs from the model's.

    Reading by element range would otherwise load a smaller checkpoint's first elements into a larger
    model (or the reverse) without a word. A rank holds slots of only some parameters (stage 3), so
    the ranks exchange the shapes they hold and every rank checks the whole model.
    """
    held = {slot.name: shards[slot.name].full_shape if slot.name in shards else tuple(slot.shape) for slot in slots}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, held)
    shapes: dict[str, tuple[int, ...]] = {}
    for rank_shapes in gathered:
        shapes.update(rank_shapes)
    in_model = [n for n, _ in module.named_parameters()]
    order = [n for n in in_model if n in shapes] + sorted(set(shapes) - set(in_model))  # the model's order
    differ = [(name, reader.shape(name), shapes[name]) for name in order
              if reader.has(name) and reader.shape(name) != shapes[name]]
    differ += [(name, reader.buffer_shape(name), tuple(buf.shape)) for name, buf in module.named_buffers()
               if name in reader.meta["buffers"] and reader.buffer_shape(name) != tuple(buf.shape)]
    if differ:
        listed = "; ".join(f"{name!r}: checkpoint {saved}, model {now}" for name, saved, now in differ)
        raise CheckpointError(
            f"{reader.path}: {len(differ)} shape(s) differ between the checkpoint and the model: {listed}. A "
            "checkpoint loads only into a model of the same shapes (load_module_strict=False skips missing names, "
            "never different shapes); build the model with the configuration it was saved from.")


def _load_optimizer(optimizer: torch.optim.Optimizer, slots: list[StateSlot], reader: AnyReader,
                    shards: dict[str, TensorShard]) -> None:
    saved = reader.meta["optimizer"]
    if saved["type"] is not None and saved["type"] != type(optimizer).__name__:
        raise CheckpointError(f"{reader.path}: optimizer state is for {saved['type']}, the engine has "
                              f"{type(optimizer).__name__}; pass load_optimizer_states=False to load weights only.")
    foreign = saved["type"] is None  # DeepSpeed's optimizer: only the hyper-parameters this one has carry over
    # DeepSpeed drops the groups left without a trainable parameter (Hugging Face's no-decay group under LoRA)
    groups = [g for g in optimizer.param_groups if not foreign or sum(p.numel() for p in g["params"])]
    if len(saved["param_groups"]) != len(groups):
        raise CheckpointError(f"{reader.path}: {len(saved['param_groups'])} optimizer parameter groups saved, "
                              f"{len(groups)} now; build the same groups as the saving run.")
    for group, hyper in zip(groups, saved["param_groups"]):
        group.update({k: (tuple(v) if isinstance(group.get(k), tuple) else v) for k, v in hyper.items()
                      if not foreign or k in group})
    for slot in slots:
        if not slot.trainable or not reader.has(slot.name):
            continue
        state, elementwise = optimizer.state[slot.opt_param], set()
        for kind in sorted(reader.kinds(slot.name)):
            if not kind.startswith("state."):
                continue
            key = kind.removeprefix("state.")
            elementwise.add(key)
            if key not in state:
                state[key] = torch.zeros_like(slot.opt_param, memory_format=torch.contiguous_format)
            flat = state[key].view(-1)[slot.opt_offset : slot.opt_offset + slot.end - slot.start]
            reader.read_into(slot.name, kind, slot.start, slot.end, flat, shards.get(slot.name))
        for key, value in saved["scalars"].items():
            if key not in elementwise:  # older manifests list a one-element first parameter's moments as scalars
                state[key] = torch.tensor(value, dtype=torch.float32, device=slot.opt_param.device)


def _load_rank_local(engine: TrainingEngine, reader: AnyReader) -> None:
    """Each rank's own state where the layout is the saving run's; otherwise the strategy falls back (on rank 0's
    or on nothing) and says what it could not restore."""
    meta = reader.meta
    same = meta["world_size"] == dist.get_world_size() and meta["topology"] == dict(engine.topology.sizes)
    own = reader.rank_local(dist.get_rank()) if same else None
    lost = engine.strategy.load_rank_local_state(own, own if own is not None else reader.rank_local(0))
    if lost and dist.get_rank() == 0:
        saved = f"world size {meta['world_size']}, topology {meta['topology']}"
        now = f"world size {dist.get_world_size()}, topology {dict(engine.topology.sizes)}"
        layout_note = "the same layout" if same else f"a different layout ({saved}; now {now})"
        logger.warning("load_checkpoint: %s was saved under %s and not restored: %s. Training goes on from the rest "
                       "of the state.", reader.path, layout_note, "; ".join(lost))


def _restore_rng(reader: AnyReader, meta: dict[str, Any]) -> None:
    rank = dist.get_rank()
    saved = reader.rng(rank)
    if saved is None and meta.get("origin") == "deepspeed":
        if rank == 0:
            logger.info("load_checkpoint: %s is a DeepSpeed checkpoint, which holds no RNG state and no data loader "
                        "position; both start afresh.", reader.path)
        return
    if saved is None:
        logger.warning("load_checkpoint: no RNG state for rank %d (saved at world size %d); RNG not restored.",
                       rank, meta["world_size"])
        return
    try:
        files.set_rng_state(*saved)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{reader.path / layout.rank_file(rank)}: its RNG state cannot be restored ({e!r}); "
                              "the file is not one shardwise wrote.") from None
