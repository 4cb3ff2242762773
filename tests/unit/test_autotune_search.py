"""The autotuner's search (autotune/search.py) against a fake machine: each candidate's throughput and peak
are given, so the order, the pruning and the stopping rules can be checked exactly."""

from __future__ import annotations

from typing import Any

from shardwise.autotune.search import DOMINATED, PRUNED, STOPPED, Outcome, Search
from shardwise.autotune.space import Candidate, read_space
from shardwise.autotune.trial import OK, OVER_BUDGET
from shardwise.config.autotuning import AutotuningConfig

RAW = {"train_batch_size": 16, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


class FakeMachine:
    """Throughput grows with the micro-batch and falls with the stage and with offloading; memory grows with the
    micro-batch and falls with the stage and offloading."""

    def __init__(self, budget: int, slow: set[str] = frozenset()):
        self.budget, self.slow, self.measured, self.bounds = budget, slow, [], []

    def peak(self, c: Candidate) -> int:
        states = 400 // (1 + c.stage) // (2 if c.offload_optimizer != "none" else 1)
        return states + 100 * c.micro + dict(c.knobs).get("zero_optimization.stage3_max_reuse_distance", 0) // 10**7

    def speed(self, c: Candidate) -> float:
        speed = 100 - 5 * c.stage + 10 * c.micro - (30 if c.offload_optimizer != "none" else 0)
        speed += 7 if dict(c.knobs).get("zero_optimization.stage3_max_reuse_distance") == 1_000_000_000 else 0
        return speed - (60 if c.name in self.slow else 0)

    def measure(self, c: Candidate, stop_below: float | None) -> Outcome:
        self.measured.append(c.name)
        self.bounds.append(stop_below)
        if self.peak(c) > self.budget:
            return Outcome(c, OVER_BUDGET, measured=self.peak(c), seconds=1.0)
        return Outcome(c, OK, metric=self.speed(c), measured=self.peak(c), seconds=10.0)


def _search(budget: int, plan_error: int = 0, raw: dict | None = None, slow: set[str] = frozenset(),
            refusal: Any = lambda c: None, **section: Any) -> tuple[Search, FakeMachine]:
    config = AutotuningConfig(**section)
    space = read_space({**RAW, **(raw or {})}, 2, config)
    machine = FakeMachine(budget, slow)
    search = Search(space, config, machine.measure, lambda c: machine.peak(c) + plan_error, budget, refusal)
    search.run()
    return search, machine


def _status(search: Search) -> dict[str, str]:
    return {o.candidate.name: o.status for o in search.outcomes}


def test_planned_over_budget_is_never_run_and_the_largest_fitting_micro_batch_goes_first() -> None:
    search, machine = _search(budget=500, tuner_early_stopping=100)
    status = _status(search)
    assert status["z0_tmbspg8_gas1"] == PRUNED and "z0_tmbspg8_gas1" not in machine.measured  # 400 + 800
    assert machine.measured[0] == "z0_tmbspg1_gas8"  # the only micro-batch stage 0 fits
    assert machine.measured[1:3] == ["z1_tmbspg2_gas4", "z1_tmbspg1_gas8"]
    # stage 3's smaller states fit micro-batch 4 (100 + 400), and the larger micro-batch pays for the stage
    assert search.best is not None and search.best.candidate.name == "z3_tmbspg4_gas2"


def test_offloading_is_measured_only_where_moving_less_does_not_fit() -> None:
    search, machine = _search(budget=500, tuner_early_stopping=100)
    status = _status(search)
    assert status["z1_tmbspg1_gas8_oocpu"] == DOMINATED  # stage 1 fits micro 1 without offload
    assert "z1_tmbspg4_gas2_oocpu" in machine.measured  # 100 + 400 fits only with the optimizer offloaded
    assert not any(status[name] == DOMINATED for name in machine.measured)


def test_a_line_stops_at_the_first_micro_batch_that_is_no_better() -> None:
    search, machine = _search(budget=10_000, slow={"z0_tmbspg4_gas2"})  # a dip: 4 is slower than 8
    status = _status(search)
    assert machine.measured[:2] == ["z0_tmbspg8_gas1", "z0_tmbspg4_gas2"]
    assert status["z0_tmbspg2_gas4"] == STOPPED and status["z0_tmbspg1_gas8"] == STOPPED


def test_a_plan_that_reads_low_is_caught_by_the_measured_peak() -> None:
    search, machine = _search(budget=500, plan_error=-300)
    status = _status(search)
    assert status["z0_tmbspg4_gas2"] == OVER_BUDGET  # planned 500, measured 800
    assert search.best is not None and search.best.measured <= 500


def test_experiments_get_half_the_best_as_their_bound_and_the_search_stops_after_misses() -> None:
    search, machine = _search(budget=10_000, tuner_early_stopping=3)
    best_first = 100 + 10 * 8
    assert machine.bounds[0] is None and machine.bounds[1] == best_first / 2
    assert len(machine.measured) == 1 + 3  # z0 micro 8 is the best; three lines in a row fail to beat it
    assert STOPPED in _status(search).values()


def test_gridsearch_measures_every_candidate_and_random_the_same_set_in_another_order() -> None:
    grid, grid_machine = _search(budget=500, tuner_type="gridsearch", tuner_num_trials=1000)
    assert len(grid_machine.measured) == len(list(grid.space.candidates()))
    assert all(bound is None for bound in grid_machine.bounds)
    shuffled, machine = _search(budget=500, tuner_type="random", tuner_num_trials=1000, tuner_early_stopping=1000)
    assert sorted(machine.measured) == sorted(grid_machine.measured) and machine.measured != grid_machine.measured
    assert grid.best is not None and grid.best.candidate == shuffled.best.candidate


def test_the_trial_cap_stops_any_search() -> None:
    _, machine = _search(budget=10_000, tuner_type="gridsearch", tuner_num_trials=4)
    assert len(machine.measured) == 4


def test_knobs_are_tuned_one_at_a_time_around_the_best() -> None:
    raw = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none"},
                                 "offload_param": {"device": "none"}, "stage3_max_reuse_distance": [0, 1e9]}}
    search, machine = _search(budget=10_000, raw=raw)
    assert machine.measured[-2:] == ["z3_tmbspg8_gas1_stage3_max_reuse_distance0",
                                     "z3_tmbspg8_gas1_stage3_max_reuse_distance1e+09"]
    assert search.best is not None and dict(search.best.candidate.knobs) == {
        "zero_optimization.stage3_max_reuse_distance": 1_000_000_000}


def test_a_refused_candidate_is_never_run_and_the_search_goes_on_without_it() -> None:
    def no_host_for_offload(c: Candidate) -> str | None:
        return "its host part is over 90% of the host memory a rank has" if c.offload_optimizer != "none" else None

    search, machine = _search(budget=500, refusal=no_host_for_offload, tuner_early_stopping=100)
    refused = [o for o in search.outcomes if o.candidate.offload_optimizer != "none"]
    assert refused and all(o.status == PRUNED for o in refused)
    assert {o.reason for o in refused} == {"planned over the budget", "its host part is over 90% of the host memory a rank has"}
    fits_the_budget = next(o for o in refused if o.candidate.name == "z1_tmbspg4_gas2_oocpu")  # 100 + 400
    assert fits_the_budget.reason == "its host part is over 90% of the host memory a rank has"
    assert not any("oocpu" in name for name in machine.measured)
    assert search.best is not None and search.best.candidate.name == "z3_tmbspg4_gas2"  # it needed no offload


def test_the_planner_refuses_offloads_the_host_cannot_hold_off_cpu_only() -> None:
    from shardwise.autotune.cli import _planner
    from shardwise.autotune.experiment import ModelInfo
    from shardwise.planner import ActivationProfile, ModelShape

    config = AutotuningConfig()
    raw = {**RAW, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": ["none", "cpu"]}}}
    space = read_space(raw, 2, config)
    shape = ModelShape(trainable=100_000_000, module_sizes=(10_000_000,) * 10)
    acts = ActivationProfile(saved_bytes=2**28, micro_batch=1, compute_bytes=4)
    offloaded = Candidate(3, 1, 8, "cpu")  # ~600 MiB of master weights and Adam state on the host per rank
    for device, host, refused in (("cuda", 2**29, True), ("cuda", 2**32, False), ("cpu", None, False)):
        planned, refusal = _planner(ModelInfo(shape, acts, 2**34, device, RAW, host), space, 2)
        assert planned(offloaded) is not None
        assert (refusal(offloaded) is not None) == refused, (device, host)
        assert refusal(Candidate(3, 1, 8)) is None  # nothing offloaded: nothing on the host
