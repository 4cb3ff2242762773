"""Checkpoints of the communication-compressed optimizers (OneBitAdam, ZeroOneAdam, OneBitLamb; ZeRO stage 0).

Resuming at the saving layout is exact, in the warm-up and after the freeze (0/1 Adam: between two syncs,
when the ranks' weights differ): each rank's compression errors and local state come back from its own file
(`strategy.rank_local_state`). At another world size that state means nothing: training goes on, and rank 0
says once what was reset. Weights-only loads and the optimizer-type check work as for any optimizer.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.distributed as dist

import shardwise
from shardwise.checkpoint import CheckpointError
from tests.harness import run_distributed
from tests.parity import make_model, param_groups, train_steps

OPTIMIZERS = {
    "OneBitAdam": {"freeze_step": 3, "betas": [0.9, 0.99]},
    # Variance updated (gradients averaged exactly) at steps 1, 2, 4; step 3 averages them in 1 bit; from
    # step 5 local steps that sync at 5, 6, 8, 12 (the interval doubles every 2 steps, at most 4).
    "ZeroOneAdam": {"var_freeze_step": 4, "var_update_scaler": 1, "local_step_scaler": 2, "local_step_clipper": 4},
    "OneBitLamb": {"freeze_step": 3},
}
SAVE_AT = {  # (warm-up, after the freeze): steps taken when the checkpoint is saved
    "OneBitAdam": (2, 6),
    "ZeroOneAdam": (3, 10),  # 3: after a 1-bit variance-phase step (errors set); 10: two local steps after a sync
    "OneBitLamb": (2, 6),
}
STEPS = 13
LOAD_LOGGER = "shardwise.checkpoint.load"


def _config(optimizer: str, world: int) -> dict:
    params = {"lr": 1e-2, **OPTIMIZERS.get(optimizer, {})}
    # The same global batch (12) at world 2 and 4; clipping exercises the local steps' shared gradient norm.
    return {"train_micro_batch_size_per_gpu": 12 // world, "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0, "steps_per_print": 1000, "optimizer": {"type": optimizer, "params": params}}


def _engine(optimizer: str, world: int):
    model = make_model()
    config = _config(optimizer, world)
    engine, *_ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=config)
    return engine


def _weights(engine) -> dict[str, torch.Tensor]:
    """This rank's weights (stage 0: every rank holds all of them; 0/1 Adam's differ between syncs)."""
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _same_on_every_rank(weights: dict[str, torch.Tensor]) -> bool:
    flat = torch.cat([v.reshape(-1).float() for v in weights.values()])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    return all(torch.equal(everyone[0], other) for other in everyone)


def _save_and_resume(root: str) -> dict[str, dict]:
    """Per optimizer on this rank: an uninterrupted run; the same run saving at both points; and, for each
    point, a fresh engine that loads it and trains to the end."""
    dist.init_process_group("gloo")
    out = {}
    for name in OPTIMIZERS:
        clean = _engine(name, 2)
        clean_losses = train_steps(clean, 0, STEPS)
        saving, saved_losses, replicated = _engine(name, 2), [], []
        for point, tag in zip(SAVE_AT[name], ("warm", "frozen")):
            saved_losses += train_steps(saving, len(saved_losses), point - len(saved_losses))
            replicated.append(_same_on_every_rank(_weights(saving)))
            saving.save_checkpoint(f"{root}/{name}", tag=tag)
        saved_losses += train_steps(saving, len(saved_losses), STEPS - len(saved_losses))
        resumed = {}
        for point, tag in zip(SAVE_AT[name], ("warm", "frozen")):
            engine = _engine(name, 2)
            engine.load_checkpoint(f"{root}/{name}", tag=tag)
            resumed[tag] = (engine.global_steps, train_steps(engine, point, STEPS - point), _weights(engine))
        out[name] = {"clean": (clean_losses, _weights(clean)), "saved": (saved_losses, _weights(saving)),
                     "replicated_at_save": replicated, "resumed": resumed}
    return out


def test_resume_is_exact_in_the_warm_up_and_after_the_freeze(tmp_path):
    ranks = run_distributed(_save_and_resume, 2, str(tmp_path), timeout=300)
    for name, (warm, frozen) in SAVE_AT.items():
        for rank, result in enumerate(ranks):
            losses, weights = result[name]["clean"]
            assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
            # Saving perturbs nothing: the saving run is the uninterrupted run, bit for bit.
            assert result[name]["saved"][0] == losses, name
            for key, value in result[name]["saved"][1].items():
                assert torch.equal(value, weights[key]), f"{name} rank {rank}: {key} changed by saving"
            for tag, point in (("warm", warm), ("frozen", frozen)):
                steps, continued, final = result[name]["resumed"][tag]
                assert steps == point
                assert continued == losses[point:], f"{name} resumed from {tag} (step {point})"
                for key, value in final.items():
                    assert torch.equal(value, weights[key]), f"{name} resumed from {tag}: rank {rank}'s {key} differs"
    # 0/1 Adam's second checkpoint is one whose ranks hold different weights (what makes its resume a test of
    # the per-rank files); the others are replicated at every save.
    assert ranks[0]["ZeroOneAdam"]["replicated_at_save"] == [True, False]
    assert ranks[0]["OneBitAdam"]["replicated_at_save"] == [True, True]
    assert ranks[0]["OneBitLamb"]["replicated_at_save"] == [True, True]


class _Warnings(logging.Handler):
    """The checkpoint loader's warnings on this rank (the harness forks ranks: pytest's caplog sees none)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _load_logged(engine, path: str, tag: str) -> tuple[str, list[str]]:
    handler, logger = _Warnings(), logging.getLogger(LOAD_LOGGER)
    logger.addHandler(handler)
    try:
        loaded, _ = engine.load_checkpoint(path, tag=tag)
    finally:
        logger.removeHandler(handler)
    return loaded, handler.messages


def _save_after_freeze(root: str) -> dict[str, dict[str, torch.Tensor]]:
    """World 2: each optimizer trained past its freeze, saved as tag "w2"; rank 0's weights (the checkpoint's)."""
    dist.init_process_group("gloo")
    out = {}
    for name in OPTIMIZERS:
        engine = _engine(name, 2)
        train_steps(engine, 0, SAVE_AT[name][1])
        engine.save_checkpoint(f"{root}/{name}", tag="w2")
        out[name] = _weights(engine)
    return out


def _load_elsewhere(root: str, tag: str, then_save: str | None) -> dict[str, dict]:
    """At this world size: load `tag`, check every rank starts from the same weights, train 3 steps (and save
    them as `then_save`)."""
    dist.init_process_group("gloo")
    out = {}
    for name in OPTIMIZERS:
        engine = _engine(name, dist.get_world_size())
        path, messages = _load_logged(engine, f"{root}/{name}", tag)
        start, steps = _weights(engine), engine.global_steps
        losses = train_steps(engine, steps, 3)
        if then_save:
            engine.save_checkpoint(f"{root}/{name}", tag=then_save)
        out[name] = {"path": path, "warnings": messages, "weights": start, "replicated": _same_on_every_rank(start),
                     "steps": (steps, engine.optimizer.steps), "losses": losses}
    return out


ERRORS_RESET = "the compression errors (zeroed: they belong to the ranks that saved them)"
LOST = {
    "OneBitAdam": ERRORS_RESET,
    "ZeroOneAdam": ERRORS_RESET + "; each rank's local 0/1 Adam steps since the last sync (rank 0's weights and "
                                  "momentum are taken as the synced state)",
    "OneBitLamb": ERRORS_RESET,  # its trust-ratio coefficients are the same on every rank: rank 0's are exact
}


def _layout_warning(path: str, saved: int, now: int, lost: str) -> str:
    def layout(world: int) -> str:
        return f"world size {world}, topology {{'pipe': 1, 'data': {world}, 'tensor': 1}}"

    return (f"load_checkpoint: {path} was saved under a different layout ({layout(saved)}; now {layout(now)}) and "
            f"not restored: {lost}. Training goes on from the rest of the state.")


def test_another_world_size_resets_the_per_rank_state_with_one_warning_from_rank_0(tmp_path):
    saved = run_distributed(_save_after_freeze, 2, str(tmp_path))[0]
    at_4 = run_distributed(_load_elsewhere, 4, str(tmp_path), "w2", "w4", timeout=300)
    back_at_2 = run_distributed(_load_elsewhere, 2, str(tmp_path), "w4", None)
    for name, lost in LOST.items():
        point = SAVE_AT[name][1]
        for world, ranks, was in ((4, at_4, 2), (2, back_at_2, 4)):
            first = ranks[0][name]
            assert first["warnings"] == [_layout_warning(first["path"], was, world, lost)], name
            for rank, result in enumerate(ranks[1:], start=1):
                # Only rank 0 speaks about the reset; ranks the saving run did not have miss their RNG state.
                missing_rng = (f"load_checkpoint: no RNG state for rank {rank} (saved at world size {was}); RNG "
                               "not restored.")
                rng = [missing_rng] if rank >= was else []
                assert result[name]["warnings"] == rng, (name, world, rank)
            for result in ranks:
                assert result[name]["replicated"], f"{name} at world {world}: ranks start from different weights"
                assert all(math.isfinite(x) for x in result[name]["losses"])
                assert result[name]["losses"] == ranks[0][name]["losses"]
            steps = point if world == 4 else point + 3
            assert first["steps"] == (steps, steps + 3), name
        # The weights loaded at world 4 are the checkpoint's (rank 0's: for 0/1 Adam, its local weights).
        for key, value in at_4[0][name]["weights"].items():
            assert torch.equal(value, saved[name][key]), f"{name}: {key}"


def _weights_only(root: str) -> dict:
    """A OneBitAdam checkpoint after the freeze, loaded into an Adam engine (with and without its optimizer
    state) and weights-only into a fresh OneBitAdam engine."""
    dist.init_process_group("gloo")
    point = SAVE_AT["OneBitAdam"][1]
    engine = _engine("OneBitAdam", 2)
    train_steps(engine, 0, point)
    engine.save_checkpoint(root, tag="onebit")
    saved = _weights(engine)
    adam = _engine("Adam", 2)
    with pytest.raises(CheckpointError) as refused:
        adam.load_checkpoint(root, tag="onebit")
    out = {"refused": str(refused.value), "saved": saved}
    for name in ("Adam", "OneBitAdam"):
        engine = _engine(name, 2)
        engine.load_checkpoint(root, tag="onebit", load_optimizer_states=False)
        loaded = _weights(engine)
        fresh = name == "Adam" or (engine.optimizer.steps == 0 and engine.optimizer.reduces_gradients()
                                   and not engine.optimizer.allreduce.worker_error.any())
        out[name] = {"weights": loaded, "fresh_optimizer": fresh, "losses": train_steps(engine, point, 2)}
    return out


def test_a_onebit_checkpoint_is_refused_by_an_adam_engine_and_loads_weights_only(tmp_path):
    ranks = run_distributed(_weights_only, 2, str(tmp_path))
    for result in ranks:
        assert result["refused"] == (f"{tmp_path}/onebit: optimizer state is for OneBitAdam, the engine has AdamW; "
                                     "pass load_optimizer_states=False to load weights only.")
        for name in ("Adam", "OneBitAdam"):
            assert result[name]["fresh_optimizer"], name  # warm-up again: exact averaging, no errors
            for key, value in result[name]["weights"].items():
                assert torch.equal(value, result["saved"][key]), f"{name}: {key}"
            assert all(math.isfinite(x) for x in result[name]["losses"])
