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
    return [step_on(engine, engine(*micro_batch(step, 0, rank, micro, 1, world))) for step in steps]


def step_on(engine: Any, loss: Any) -> float:
    """Backward and step on this rank's `loss`; the mean of every rank's (the global batch's, for equal slices)."""
    import torch.distributed as dist

    engine.backward(loss)
    engine.step()
    total = loss.detach().float().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _library(name: str) -> Any:
    """`deepspeed` (the real one, its process group started) or `shardwise`."""
    import importlib

    library = importlib.import_module(name)
    if name == "deepspeed":
        library.init_distributed(dist_backend="gloo")
    return library


def save_and_continue(name: str, root: str, cases: dict[str, tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, list[float]]:
    """On each rank, with library `name`: for each case (ZeRO section, precision section), train SAVED_AT steps,
    save to `root/<case>` (client_state {"case": case}), train MORE steps; their losses, by case."""
    library = _library(name)
    after = {}
    for case, (zero, precision) in cases.items():
        model = make_model()
        engine, *_ = library.initialize(model=model, model_parameters=param_groups(model),
                                        config=config(zero, precision, int(os.environ["WORLD_SIZE"])))
        train(engine, range(SAVED_AT))
        engine.save_checkpoint(str(Path(root) / case), client_state={"case": case})
        after[case] = train(engine, range(SAVED_AT, SAVED_AT + MORE))
    return after


def resumed_precision(saved: dict[str, Any]) -> dict[str, Any]:
    """The saving run's precision section, but fp16 starting at a loss scale of 2**4: the checkpoint's must win."""
    return {"fp16": {**saved["fp16"], "initial_scale_power": 4}} if "fp16" in saved else saved


def _loss_scale(engine: Any) -> float | None:
    """The engine's current loss scale: shardwise's scaler, or DeepSpeed's ZeRO optimizer's."""
    scaler = getattr(getattr(engine, "precision", None), "loss_scaler", None)
    if scaler is not None:
        return scaler.state_dict().get("scale")
    return getattr(getattr(engine.optimizer, "loss_scaler", None), "cur_scale", None)


def _resumed_model() -> Any:
    """TinyNet with other trainable weights than the saved run started from (only the checkpoint can make the
    losses agree) and the same frozen ones: a fine-tune's frozen base is the pretrained model, built the same way
    in every run (DeepSpeed's ZeRO-3 resume takes frozen weights from the model, not the checkpoint)."""
    import torch

    model, base = make_model(seed=1), make_model()
    with torch.no_grad():
        for (name, param), (_, original) in zip(model.named_parameters(), base.named_parameters()):
            if not param.requires_grad:
                param.copy_(original)
    return model


def resume(name: str, loads: list[tuple[str, int, dict[str, Any]]]) -> dict[tuple[str, int], dict[str, Any]]:
    """On each rank, with library `name`: for each (save directory, ZeRO stage, precision section), an engine at
    this world size loads the checkpoint and trains MORE steps; its losses, client state's case and step count."""
    library = _library(name)
    world = int(os.environ["WORLD_SIZE"])
    out = {}
    for root, stage, precision in loads:
        model = _resumed_model()
        engine, *_ = library.initialize(model=model, model_parameters=param_groups(model),
                                        config=config({"stage": stage}, precision, world))
        _, client = engine.load_checkpoint(root)
        out[(root, stage)] = {"losses": train(engine, range(SAVED_AT, SAVED_AT + MORE)), "case": client.get("case"),
                              "global_steps": engine.global_steps, "loss_scale": _loss_scale(engine)}
    return out
