"""The curriculum sampler's rules ([Note: curriculum sampling rules] in data_efficiency/sampler.py): only
admitted samples, exactly once per pass, deterministic, resumable from its JSON state; and the loader's split
of each global batch across ranks and micro-steps."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from shardwise.config.data_efficiency import DataCurriculumConfig
from shardwise.data_efficiency import CurriculumSampler, DataAnalyzer, MetricIndex
from shardwise.data_efficiency.loader import CurriculumLoader

N = 40
LENGTH = np.array([(7 * i) % 10 + 1 for i in range(N)])  # metric "len": 1..10, four samples each
RARE = np.array([(3 * i) % 8 for i in range(N)])


def write_index(path: Path) -> dict[str, MetricIndex]:
    data = [{"len": torch.tensor(int(a)), "rare": torch.tensor(int(b))} for a, b in zip(LENGTH, RARE)]
    DataAnalyzer(data, ["len", "rare"], [lambda b: b["len"], lambda b: b["rare"]],
                 ["single_value_per_sample"] * 2, path, batch_size=16).run_map_reduce()
    return {m: MetricIndex.open(m, path / m, N) for m in ("len", "rare")}


def curriculum(**metrics: dict) -> DataCurriculumConfig:
    return DataCurriculumConfig(enabled=True, curriculum_metrics=metrics)


LINEAR = {"min_difficulty": 2, "max_difficulty": 10, "schedule_type": "fixed_linear",
          "schedule_config": {"total_curriculum_step": 8, "difficulty_step": 2}}


@pytest.fixture
def indexes(tmp_path: Path) -> dict[str, MetricIndex]:
    return write_index(tmp_path)


def test_only_admitted_samples_and_exactly_once(indexes: dict[str, MetricIndex]) -> None:
    sampler = CurriculumSampler(curriculum(len=LINEAR), {"len": indexes["len"]}, N, global_batch_size=6, seed=3)
    draws: list[tuple[int, int]] = []  # (step, sample)
    pass_after: dict[int, int] = {0: 0}
    pass_of: dict[int, int] = {}  # a step's pass (a step that starts a pass counts in the one it ends)
    within_pass: dict[int, list[int]] = {}  # a pass's draws in steps that stay inside it
    for _ in range(30):
        before = sampler.passes
        batch = sampler.next_global_batch()
        limit = sampler.schedules["len"].difficulty(sampler.step)
        assert len(batch) == 6 and (LENGTH[batch] <= limit).all(), (sampler.step, limit, LENGTH[batch])
        draws += [(sampler.step, int(s)) for s in batch]
        pass_after[sampler.step], pass_of[sampler.step] = sampler.passes, before
        if sampler.passes == before:
            within_pass.setdefault(before, []).extend(batch.tolist())
    assert sampler.passes >= 2  # the run went round the (finally whole) dataset more than twice
    assert all(len(v) == len(set(v)) for v in within_pass.values())  # never twice within a pass
    last: dict[int, int] = {}
    for step, s in draws:
        if s in last and last[s] < step:  # drawn again: every sample admitted then was drawn in that pass
            limit = sampler.schedules["len"].difficulty(last[s])
            start = min(st for st, p in pass_after.items() if p == pass_of[last[s]])
            drawn = {x for st, x in draws if start <= st <= step}
            assert {i for i in range(N) if LENGTH[i] <= limit} <= drawn, (s, step)
        last[s] = step


def test_percentile_and_intersection_of_metrics(indexes: dict[str, MetricIndex]) -> None:
    pct = {"min_difficulty": 50, "max_difficulty": 100, "schedule_type": "fixed_discrete", "difficulty_type":
           "percentile", "schedule_config": {"difficulty": [50, 100], "max_step": [3]}}
    value = {"min_difficulty": 3, "max_difficulty": 7, "schedule_type": "fixed_discrete",
             "schedule_config": {"difficulty": [3, 7], "max_step": [3]}}
    sampler = CurriculumSampler(curriculum(len=pct, rare=value), indexes, N, global_batch_size=4, seed=0)
    easiest_half = set(np.argsort(LENGTH, kind="stable")[: N // 2].tolist())
    admitted = easiest_half & {i for i in range(N) if RARE[i] <= 3}
    assert set(sampler.admitted({"len": 50, "rare": 3}).tolist()) == admitted
    for _ in range(3):
        assert set(sampler.next_global_batch().tolist()) <= admitted
    assert set(sampler.admitted({"len": 100, "rare": 7}).tolist()) == set(range(N))


def test_deterministic_for_the_seed(indexes: dict[str, MetricIndex]) -> None:
    def run(seed: int) -> list[list[int]]:
        s = CurriculumSampler(curriculum(len=LINEAR), {"len": indexes["len"]}, N, global_batch_size=6, seed=seed)
        return [s.next_global_batch().tolist() for _ in range(12)]

    assert run(5) == run(5) and run(5) != run(6)


def test_resume_from_json_state_draws_the_same_batches(indexes: dict[str, MetricIndex]) -> None:
    def fresh() -> CurriculumSampler:
        return CurriculumSampler(curriculum(len=LINEAR), {"len": indexes["len"]}, N, global_batch_size=7, seed=1)

    whole = fresh()
    expected = [whole.next_global_batch().tolist() for _ in range(25)]
    first = fresh()
    for _ in range(11):
        first.next_global_batch()
    resumed = fresh()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert [resumed.next_global_batch().tolist() for _ in range(14)] == expected[11:]
    other = CurriculumSampler(curriculum(len=LINEAR), {"len": indexes["len"]}, N, global_batch_size=7, seed=2)
    with pytest.raises(ValueError, match=r"data_loader: the checkpoint's curriculum sampler has seed=1; this one has "
                       r"seed=2"):
        other.load_state_dict(first.state_dict())


def test_custom_schedule_unknown_metric(indexes: dict[str, MetricIndex]) -> None:
    sampler = CurriculumSampler(curriculum(len=LINEAR), {"len": indexes["len"]}, N, global_batch_size=6, seed=3)
    with pytest.raises(KeyError, match=r"no curriculum metric named \['seqlen'\]; the config's curriculum_metrics "
                       r"are \['len'\]"):
        sampler.set_custom_schedule({"seqlen": lambda s: s})


def test_loader_splits_each_global_batch_across_ranks_and_micro_steps(indexes: dict[str, MetricIndex]) -> None:
    def loaders(dp: int, micro: int) -> list[CurriculumLoader]:
        return [CurriculumLoader(list(range(N)), CurriculumSampler(curriculum(len=LINEAR), {"len": indexes["len"]},
                                                                   N, 8, seed=4), micro, r, dp, num_epochs=2)
                for r in range(dp)]

    reference = CurriculumSampler(curriculum(len=LINEAR), {"len": indexes["len"]}, N, 8, seed=4)
    batches = [reference.next_global_batch().tolist() for _ in range(10)]  # 80 samples = 2 epochs of 40
    for dp, micro in ((2, 2), (1, 4), (4, 1)):
        per_rank = [[b.tolist() for b in loader] for loader in loaders(dp, micro)]
        steps = 8 // (micro * dp)
        assert all(len(r) == 10 * steps for r in per_rank)
        for k, batch in enumerate(batches):
            for j in range(steps):
                width = micro * dp
                chunk = batch[j * width: (j + 1) * width]
                assert [per_rank[r][k * steps + j] for r in range(dp)] == [chunk[r::dp] for r in range(dp)]
