"""The run both sides of a DeepSpeed-checkpoint migration train: TinyNet, AdamW + WarmupLR, a global batch of 4
at any world size, saved at step SAVED_AT and continued for MORE steps (test_deepspeed_checkpoint_migration.py
with the real DeepSpeed, test_deepspeed_checkpoint_fixtures.py from the files it wrote)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tests.parity import make_model, micro_batch, param_groups

SAVED_AT, MORE, GLOBAL_BATCH = 3, 3, 4
FIXTURES = Path(__file__).parent / "data" / "deepspeed_0_19_8_checkpoints"


def config(zero: dict[str, Any], precision: dict[str, Any], world: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "steps_per_print": 10_000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.99], "eps": 1e-8}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 5}},
        "zero_optimization": zero,
        **precision,
    }


def train(engine: Any, steps: range) -> list[float]:
    """The losses (mean over the global batch) of `steps`, each rank on its slice of the global batch."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    micro = GLOBAL_BATCH // world
    losses = []
    for step in steps:
        loss = engine(*micro_batch(step, 0, rank, micro, 1, world))
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def save_with_deepspeed(root: str, cases: dict[str, tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, list[float]]:
    """On each rank, with the real DeepSpeed: for each case (ZeRO section, precision section), train SAVED_AT
    steps, save to `root/<case>` (client_state {"case": case}), train MORE steps; their losses, by case."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    after = {}
    for case, (zero, precision) in cases.items():
        model = make_model()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model),
                                          config=config(zero, precision, int(os.environ["WORLD_SIZE"])))
        train(engine, range(SAVED_AT))
        engine.save_checkpoint(str(Path(root) / case), client_state={"case": case})
        after[case] = train(engine, range(SAVED_AT, SAVED_AT + MORE))
    return after


def resume_with_shardwise(loads: list[tuple[str, int, dict[str, Any]]]) -> dict[tuple[str, int], dict[str, Any]]:
    """On each rank: for each (DeepSpeed save directory, ZeRO stage, precision section), a shardwise engine at this
    world size loads the checkpoint and trains MORE steps; its losses, client state and step count."""
    import shardwise

    world = int(os.environ["WORLD_SIZE"])  # set by the harness; shardwise.initialize starts the process group
    out = {}
    for root, stage, precision in loads:
        model = make_model(seed=1)  # other initial weights: only the checkpoint can make the losses agree
        engine, *_ = shardwise.initialize(model=model, model_parameters=param_groups(model),
                                          config=config({"stage": stage}, precision, world))
        _, client = engine.load_checkpoint(root)
        out[(root, stage)] = {"losses": train(engine, range(SAVED_AT, SAVED_AT + MORE)), "client": client,
                              "global_steps": engine.global_steps,
                              "loss_scale": engine.precision.loss_scaler.state_dict().get("scale")}
    return out
