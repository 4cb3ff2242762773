"""What watches a run from above profiling/: the planner's check of its plan against step 2 (`memory_breakdown:
true`) and an autotuning experiment's report (a config `shardwise autotune` wrote: autotune/trial.py). They are
attached to the engine's instruments as step listeners here, in the runtime, so that profiling/ imports
nothing of the packages that sit above it."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..autotune.trial import Trial
from ..config.notes import note_once
from ..planner.probe import PlanProbe

if TYPE_CHECKING:
    from ..protocols.engine import TrainingEngine as Engine

logger = logging.getLogger("shardwise")


def plan_probe(engine: Engine) -> PlanProbe | None:
    """The step-2 check, with `memory_breakdown: true` or when an experiment needs its measured peak."""
    if not (engine.config.memory_breakdown or engine.config.autotuning.measures):
        return None
    instruments = engine.instruments
    probe = PlanProbe(engine.config, engine.module, engine.device, engine.topology.data.size,
                      instruments.memory_breakdown, lambda: instruments.activations.peak, engine.global_rank)
    instruments.step_listeners.append(probe)
    return probe


def autotune_trial(engine: Engine, probe: PlanProbe | None) -> Trial | None:
    section = engine.config.autotuning
    if section.enabled and not section.measures:
        note_once(logger, logging.WARNING, "autotuning.enabled: this run was not started by `shardwise autotune` (or "
                  "`--autotuning tune|run`), so it trains with its config as written and tunes nothing.")
    if not section.measures or probe is None:
        return None
    instruments = engine.instruments
    trial = Trial(engine.config, engine.module, engine.device, engine.global_rank, engine.topology.data.size, probe,
                  lambda: instruments.activations.peak)
    instruments.step_listeners.append(trial)
    return trial
