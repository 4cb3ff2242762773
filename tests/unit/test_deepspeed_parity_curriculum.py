"""Our difficulty schedules (and the compat CurriculumScheduler's API) against DeepSpeed's CurriculumScheduler,
value for value. Skips without the real DeepSpeed (tests/reference.py); `make test-deepspeed` runs it against
deepspeed==0.19.8."""

from __future__ import annotations

import pytest

from tests.reference import real_deepspeed

real_deepspeed()
from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler  # noqa: E402

from shardwise.data_efficiency.seqlen import LegacyCurriculumScheduler  # noqa: E402

CASES = [
    {"min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_linear",
     "schedule_config": {"total_curriculum_step": 20, "difficulty_step": 8}},
    {"min_difficulty": 5, "max_difficulty": 30, "schedule_type": "fixed_linear",  # step does not divide min or max
     "schedule_config": {"total_curriculum_step": 13, "difficulty_step": 4}},
    {"min_difficulty": 8, "max_difficulty": 1024, "schedule_type": "fixed_root",
     "schedule_config": {"total_curriculum_step": 30, "difficulty_step": 16, "root_degree": 2}},
    {"min_difficulty": 3, "max_difficulty": 100, "schedule_type": "fixed_root",
     "schedule_config": {"total_curriculum_step": 17, "difficulty_step": 8, "root_degree": 3}},
    {"min_difficulty": 1, "max_difficulty": 4, "schedule_type": "fixed_discrete",
     "schedule_config": {"difficulty": [1, 2, 4], "max_step": [3, 9]}},
]  # fmt: skip
STEPS = [*range(0, 45), 100, 10_000]


@pytest.mark.parametrize("config", CASES, ids=lambda c: c["schedule_type"])
def test_same_difficulties_as_deepspeed(config: dict) -> None:
    theirs, ours = CurriculumScheduler(dict(config)), LegacyCurriculumScheduler(dict(config))
    assert [ours.get_difficulty(s) for s in STEPS] == [theirs.get_difficulty(s) for s in STEPS]
    assert [ours.update_difficulty(s) for s in STEPS] == [theirs.update_difficulty(s) for s in STEPS]
    assert ours.get_current_difficulty() == theirs.state["current_difficulty"]


def test_custom_schedule_same_as_deepspeed() -> None:
    config = {"min_difficulty": 2, "max_difficulty": 9, "schedule_type": "custom"}
    theirs, ours = CurriculumScheduler(dict(config)), LegacyCurriculumScheduler(dict(config))
    for s in (theirs, ours):
        s.set_custom_get_difficulty(lambda step: min(9, 2 + step // 3))
    assert [ours.update_difficulty(s) for s in STEPS] == [theirs.update_difficulty(s) for s in STEPS]
