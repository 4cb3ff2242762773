"""How far training has got, as a checkpoint records it, and how a resumed run takes it up.

[Note: resuming under another batch layout] The same global batch (train_batch_size) can be laid out as
micro-batch × gradient_accumulation_steps × data-parallel size in many ways, and a run may resume in
another one. Two things carry over by what they mean, not by their saved values:
- the accumulation window: the resumed run's next micro-batch opens a new window (its `micro_steps` is
  set to global_steps × its own gradient_accumulation_steps), so every step again spans one global
  batch. A checkpoint saved inside a window holds none of that window's gradients: the resumed run
  drops those micro-batches (their samples count as read) and warns, at the save and at the load.
- the data loader's place: the samples consumed in the epoch, all ranks together (see
  [Note: epoch position] in `runtime/sample_order.py`), which each layout splits its own way.
A changed global batch is taken up too (the run goes on from the same step and sample), with a warning
naming both sizes: from there on it is not the run the checkpoint came from.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from ..protocols import TrainingEngine

logger = logging.getLogger(__name__)

COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps", "window_micro_steps")


def progress_meta(engine: TrainingEngine) -> dict[str, Any]:
    """The manifest's `counters` and `data_loader` entries (every rank computes the same)."""
    pending = engine.window_micro_steps
    if pending and dist.get_rank() == 0:
        logger.warning(
            "save_checkpoint: saved inside a gradient accumulation window (%d of %d micro-batches of step %d "
            "accumulated); the checkpoint does not hold their gradients, so a run resumed from it drops them. "
            "Save right after the engine.step() that ends a window (is_gradient_accumulation_boundary() true "
            "before it) to resume exactly.", pending, engine.gradient_accumulation_steps(), engine.global_steps + 1)
    loader = engine.training_dataloader
    return {
        "counters": {k: getattr(engine, k) for k in COUNTERS},
        "data_loader": loader.state_dict() if hasattr(loader, "state_dict") else None,
    }


def restore_progress(engine: TrainingEngine, meta: dict[str, Any]) -> None:
    """Take up the saved counters and loader position in this engine's batch layout (see the note)."""
    counters, saved = meta["counters"], meta["config"]
    for key in ("global_steps", "global_samples", "skipped_steps"):
        setattr(engine, key, counters[key])
    # Checkpoints from before `window_micro_steps` was recorded: exact unless set_gradient_accumulation_boundary
    # moved the windows.
    pending = counters.get("window_micro_steps", counters["micro_steps"] % saved["gradient_accumulation_steps"])
    rank0 = dist.get_rank() == 0
    if pending and rank0:
        logger.warning(
            "load_checkpoint: the checkpoint was saved inside a gradient accumulation window (%d of %d "
            "micro-batches of step %d accumulated) and holds none of their gradients; they are dropped and "
            "step %d starts a new window.", pending, saved["gradient_accumulation_steps"],
            counters["global_steps"] + 1, counters["global_steps"] + 1)
    engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps()
    engine.window_micro_steps = 0
    if saved["train_batch_size"] != engine.train_batch_size() and rank0:
        logger.warning(
            "load_checkpoint: train_batch_size is %d, the checkpoint was saved with %d; training goes on after "
            "step %d (%d samples) with the new global batch, so it no longer follows the saved run (the learning "
            "rate schedule counts steps). Keep train_batch_size at %d to continue that run exactly.",
            engine.train_batch_size(), saved["train_batch_size"], engine.global_steps, engine.global_samples,
            saved["train_batch_size"])
    loader = engine.training_dataloader
    state = meta.get("data_loader")
    if state and hasattr(loader, "load_state_dict"):
        if "consumed" not in state:  # the old format counts batches per rank: the saving layout converts them
            state = {**state, "micro_batch_size": saved["train_micro_batch_size_per_gpu"],
                     "dp_size": meta["topology"]["data"]}
        loader.load_state_dict(state)
