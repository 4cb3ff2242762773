"""The order in which `shardwise autotune` measures candidates, and what it does not measure at all.

[Note: the planner-guided search] (`tuner_type: model_based`, the default) For each ZeRO stage and offload
mode, moving less first:
1. every micro-batch is planned (planner/plan.py, from the profiled model); those planned over the budget are
   pruned, and so are those that a mode moving less already fits (offloading is slower: it is worth its cost
   only where it makes a config fit);
2. the micro-batches left are measured from the largest down, until one is no better than the best of its
   line: a larger micro-batch runs the same work in fewer, fuller steps, so the best usually sits at the top;
3. an experiment gets the bound `stop_below` (HOPELESS_SHARE of the best so far): one already that far
   behind after its first timed step stops there.
The search ends after `tuner_early_stopping` experiments in a row that did not improve on the best, or
`tuner_num_trials` experiments. With `fast: false` (or knob lists in the config), each knob is then tuned in
turn around the best candidate (coordinate descent), planned and pruned the same way.

`gridsearch` measures every candidate (the exhaustive baseline); `random` measures them in a seeded random
order; neither plans, and both stop only at `tuner_num_trials` (random also after `tuner_early_stopping`).
An experiment that does not fit (its measured peak over `memory_per_rank`, or an out-of-memory error) counts
as measured; a pruned one costs nothing.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from ..config.autotuning import AutotuningConfig
from .space import Candidate, Space
from .trial import OK, OVER_BUDGET

HOPELESS_SHARE = 0.5
PRUNED, DOMINATED, STOPPED = "pruned", "dominated", "not run"
OUT_OF_MEMORY, FAILED, TIMED_OUT = "oom", "failed", "timeout"


@dataclass
class Outcome:
    candidate: Candidate
    status: str
    """ok, over_budget, oom, failed, timeout, hopeless (measured); pruned, dominated, not run (not measured)."""
    metric: float | None = None
    planned: int | None = None
    measured: int | None = None
    seconds: float = 0.0
    reason: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    resumed: bool = False

    @property
    def ran(self) -> bool:
        return self.status not in (PRUNED, DOMINATED, STOPPED)


Measure = Callable[[Candidate, "float | None"], Outcome]
Plan = Callable[[Candidate], "int | None"]
Refusal = Callable[[Candidate], "str | None"]
"""Why a candidate cannot run whatever the device budget (its offload over the host's memory, say), or None."""


class Search:
    def __init__(self, space: Space, section: AutotuningConfig, measure: Measure, plan: Plan, budget: int | None,
                 refusal: Refusal = lambda candidate: None):
        self.space, self.section, self._measure, self._plan, self.budget = space, section, measure, plan, budget
        self._refusal = refusal
        self.outcomes: list[Outcome] = []
        self.best: Outcome | None = None
        self._misses = 0

    # --- ranking -------------------------------------------------------------------------------------
    def better(self, a: float, b: float) -> bool:
        return a < b if self.section.metric == "latency" else a > b

    def _bound(self) -> float | None:
        if self.best is None or self.best.metric is None:
            return None
        value = self.best.metric
        return value / HOPELESS_SHARE if self.section.metric == "latency" else value * HOPELESS_SHARE

    @property
    def done(self) -> bool:
        measured = sum(o.ran for o in self.outcomes)
        stop_early = self.section.tuner_type != "gridsearch" and self._misses >= self.section.tuner_early_stopping
        return measured >= self.section.tuner_num_trials or stop_early

    def measure(self, candidate: Candidate, planned: int | None = None) -> Outcome:
        outcome = self._measure(candidate, self._bound() if self.section.tuner_type == "model_based" else None)
        outcome.planned = planned if planned is not None else outcome.planned
        self.outcomes.append(outcome)
        improved = outcome.status == OK and outcome.metric is not None and (
            self.best is None or self.best.metric is None or self.better(outcome.metric, self.best.metric))
        if improved:
            self.best = outcome
        self._misses = 0 if improved else self._misses + 1
        return outcome

    def skip(self, candidate: Candidate, status: str, planned: int | None, reason: str) -> None:
        self.outcomes.append(Outcome(candidate, status, planned=planned, reason=reason))

    # --- strategies ----------------------------------------------------------------------------------
    def run(self) -> list[Outcome]:
        if self.section.tuner_type == "model_based":
            self._guided()
            self._knobs()
        else:
            self._in_order()
        return self.outcomes

    def _in_order(self) -> None:
        candidates = list(self._with_all_knobs())
        if self.section.tuner_type == "random":
            random.Random(0).shuffle(candidates)
        for candidate in candidates:
            if self.done:
                self.skip(candidate, STOPPED, None, "the search had stopped")
                continue
            self.measure(candidate)

    def _with_all_knobs(self) -> Iterator[Candidate]:
        for candidate in self.space.candidates():
            grid: list[dict[str, int]] = [{}]
            for key, values in self.space.knob_values(candidate.stage).items():
                grid = [{**g, key: v} for g in grid for v in values]
            for knobs in grid:
                yield candidate.with_knobs(knobs) if knobs else candidate

    def _guided(self) -> None:
        """See [Note: the planner-guided search]."""
        for stage in self.space.stages:
            fitted: set[int] = set()  # micro-batches a mode moving less fits at this stage
            for optimizer, params in self.space.offload_modes(stage):
                line = [Candidate(stage, m, g, optimizer, params) for m, g in self.space.micro_batches]
                self._line(line, fitted)

    def _line(self, line: list[Candidate], fitted: set[int]) -> None:
        """One stage and offload mode over the micro-batches; `fitted` gathers those that fit, by plan and,
        where measured, by measurement, for the modes that move more."""
        runnable = []
        for candidate in line:
            planned, pruned = self._pruned(candidate)
            if pruned:
                self.skip(candidate, PRUNED, planned, pruned)
            elif candidate.micro in fitted:
                self.skip(candidate, DOMINATED, planned, "fits with less offloaded")
            else:
                runnable.append((candidate, planned))
        failed = self._measure_line(runnable)
        fitted.update(c.micro for c, _ in runnable if c.micro not in failed)

    def _measure_line(self, runnable: list[tuple[Candidate, int | None]]) -> set[int]:
        """Measures from the largest micro-batch down (see the note); returns the micro-batches that did not fit."""
        line_best: float | None = None
        failed: set[int] = set()
        for i in range(len(runnable) - 1, -1, -1):
            candidate, planned = runnable[i]
            if self.done:
                self.skip(candidate, STOPPED, planned, "the search had stopped")
                continue
            outcome = self.measure(candidate, planned)
            if outcome.status in (OVER_BUDGET, OUT_OF_MEMORY):
                failed.add(candidate.micro)
            if outcome.status != OK or outcome.metric is None:
                continue  # a smaller micro-batch may still fit, or run
            if line_best is not None and not self.better(outcome.metric, line_best):
                for rest, rest_planned in runnable[:i]:
                    self.skip(rest, STOPPED, rest_planned, "a larger micro-batch of this line was better")
                break
            line_best = outcome.metric
        return failed

    def _knobs(self) -> None:
        if self.best is None:
            return
        for key, values in self.space.knob_values(self.best.candidate.stage).items():
            center = self.best.candidate
            for value in values:
                if self.done:
                    return
                candidate = center.with_knobs({**dict(center.knobs), key: value})
                if candidate == center or any(o.candidate == candidate for o in self.outcomes):
                    continue
                planned, pruned = self._pruned(candidate)
                if pruned:
                    self.skip(candidate, PRUNED, planned, pruned)
                    continue
                self.measure(candidate, planned)

    def _pruned(self, candidate: Candidate) -> tuple[int | None, str | None]:
        """The candidate's planned peak, and why the plan rules it out (None where it may run)."""
        planned = self._plan(candidate)
        if planned is None:
            return None, "the config is refused (see `shardwise plan`)"
        if self.budget is not None and planned > self.budget:
            return planned, "planned over the budget"
        return planned, self._refusal(candidate)
