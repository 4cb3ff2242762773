"""What watches a run from above profiling/: the planner's check of its plan against step 2 (`memory_breakdown:
true`). It is attached to the engine's instruments as a step listener here, in the runtime, so that profiling/
imports nothing of the planner that sits above it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..planner.probe import PlanProbe

if TYPE_CHECKING:
    from .engine import Engine


def plan_probe(engine: Engine) -> PlanProbe | None:
    if not engine.config.memory_breakdown:
        return None
    instruments = engine.instruments
    probe = PlanProbe(engine.config, engine.module, engine.device, engine.topology.data.size,
                      instruments.memory_breakdown, lambda: instruments.activations.peak, engine.global_rank)
    instruments.step_listeners.append(probe)
    return probe
