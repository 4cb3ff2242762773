"""Our difficulty schedules (and the compat CurriculumScheduler's API) against DeepSpeed's CurriculumScheduler,
and random-LTD's kept-token schedule and layer-token count against its RandomLTDScheduler, value for value.
Skips without the real DeepSpeed (tests/reference.py); `make test-deepspeed` runs it against deepspeed==0.19.8."""

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


def _random_ltd_section(min_value: int, max_value: int, require_steps: int, seq_per_step: int) -> dict:
    return {"enabled": True, "total_layer_num": 6, "random_ltd_layer_num": 4, "random_ltd_layer_id": [1, 2, 3, 4],
            "model_mask_name": "attention_mask", "model_type": "decoder", "hidden_state_order": "batch_seq_dim",
            "random_ltd_schedule": {"min_value": min_value, "max_value": max_value, "schedule_type": "fixed_linear",
                                    "schedule_config": {"require_steps": require_steps, "seq_per_step": seq_per_step}},
            "layer_token_lr_schedule": {"enabled": False}}


@pytest.mark.parametrize("values", [(16, 128, 20, 16), (10, 70, 13, 8), (64, 64, 5, 64)], ids=str)
def test_random_ltd_kept_tokens_and_layer_tokens_as_deepspeed(values: tuple[int, int, int, int]) -> None:
    from deepspeed.runtime.data_pipeline.data_routing.scheduler import RandomLTDScheduler as Theirs

    from shardwise.config.data_efficiency import RandomLTDConfig
    from shardwise.data_efficiency.random_ltd import RandomLTDScheduler

    section = _random_ltd_section(*values)
    theirs = Theirs({**section, "global_batch_size": 8, "micro_batch_size": 2})
    ours = RandomLTDScheduler(RandomLTDConfig(**section), seed=0, dp_rank=0, global_batch_size=8)
    for step in [*range(0, 30), 100]:
        theirs.update_seq(step)
        ours.update_seq(step)
        assert ours.get_current_seq() == theirs.get_current_seq(), step
    # DeepSpeed sums layer tokens step by step as it is shown them; ours computes the sum from the step count.
    fresh = Theirs({**section, "global_batch_size": 8, "micro_batch_size": 2})
    assert ours.get_total_layer_tokens(30) == fresh.get_total_layer_tokens(30)
