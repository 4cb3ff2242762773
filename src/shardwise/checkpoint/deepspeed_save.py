"""`checkpoint.format: "deepspeed"`: save in DeepSpeed's layout, for a run to go back to DeepSpeed.

The engine saves as always (every rank its pieces, atomically) into a staging folder beside the tags, then rank
0 converts that checkpoint to DeepSpeed's layout at this run's data-parallel size and ZeRO stage
(deepspeed_export.py), publishes the tag and `latest`, and removes the staging folder. Every rank returns, or
raises the same error. The conversion reads the whole checkpoint on rank 0, one parameter slice at a time: a
save takes about twice as long as a shardwise one, which is the price of a format DeepSpeed reads.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..protocols import TrainingEngine
from .deepspeed_export import export_deepspeed
from .errors import CheckpointError

STAGING = ".shardwise-staging"


def save_in_deepspeed_layout(engine: TrainingEngine, save_dir: str, tag: str | None, client_state: dict[str, Any],
                             save_latest: bool, exclude_frozen: bool) -> str:
    stage = engine.config.zero_optimization.stage
    if stage == 0:
        raise CheckpointError("save_checkpoint: checkpoint.format \"deepspeed\" writes DeepSpeed's ZeRO layout, stages "
                              "1-3; this run is at stage 0. Set zero_optimization.stage, or save in shardwise's format "
                              "and go back to DeepSpeed with weights only (shardwise checkpoint to-fp32).")
    root = Path(save_dir)
    staging = root / STAGING
    saved = engine.checkpoint_writer.save(engine, str(staging), tag, client_state, save_latest=False,
                                          exclude_frozen=exclude_frozen)
    engine.checkpoint_writer.wait()  # the conversion reads the complete checkpoint
    saved_tag = Path(saved).name
    problem = None
    if dist.get_rank() == 0:
        try:
            export_deepspeed(staging, root, engine.topology.data.size, stage, source_tag=saved_tag, tag=saved_tag,
                             replace=True, latest=save_latest)
        except CheckpointError as e:
            problem = str(e)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    box = [problem]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise CheckpointError(f"save_checkpoint: {box[0]}")
    return str(root / saved_tag)
