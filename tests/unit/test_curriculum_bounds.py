"""Curriculum difficulties outside what the schedule allows are refused when the config is parsed, naming the key,
the value and the allowed range, in both the legacy `curriculum_learning` section and a data-sampling metric."""

from __future__ import annotations

import pytest
import torch

from shardwise.config import ConfigError, parse_config
from shardwise.config.data_efficiency import LegacyCurriculumConfig
from shardwise.data_efficiency import CurriculumError
from shardwise.data_efficiency.seqlen import SeqlenCurriculum

DISCRETE = {"min_difficulty": 8, "max_difficulty": 16, "schedule_type": "fixed_discrete",
            "schedule_config": {"difficulty": [2, 48, 4], "max_step": [5, 10]}}
LINEAR = {"min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_linear",
          "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8}}
METRIC_PATH = "data_efficiency.data_sampling.curriculum_learning.curriculum_metrics.seqlen"


def _legacy(**section: object) -> dict:
    return {"curriculum_learning": {"enabled": True, "curriculum_type": "seqlen", **section}}


def _metric(**metric: object) -> dict:
    return {"data_efficiency": {"enabled": True, "data_sampling": {"enabled": True, "curriculum_learning": {
        "enabled": True, "curriculum_metrics": {"seqlen": {"index_to_sample_path": "s", "index_to_metric_path": "m",
                                                           **metric}}}}}}


def _error(raw: dict) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config({"train_micro_batch_size_per_gpu": 2, **raw})
    return str(info.value)


@pytest.mark.parametrize("wrap, where", [(_legacy, "curriculum_learning"), (_metric, METRIC_PATH)])
def test_discrete_levels_outside_the_bounds_are_refused(wrap, where: str) -> None:  # noqa: ANN001
    text = _error(wrap(**DISCRETE))
    assert (f"{where}.schedule_config.difficulty: every level must lie within [min_difficulty, max_difficulty] = "
            "[8, 16]; got 2, 48, 4 (in [2, 48, 4])") in text


@pytest.mark.parametrize("wrap, where", [(_legacy, "curriculum_learning"), (_metric, METRIC_PATH)])
def test_a_difficulty_step_with_no_multiple_in_the_bounds_is_refused(wrap, where: str) -> None:  # noqa: ANN001
    for kind, extra in (("fixed_linear", {}), ("fixed_root", {"root_degree": 2})):
        text = _error(wrap(min_difficulty=9, max_difficulty=15, schedule_type=kind,
                           schedule_config={"total_curriculum_step": 10, "difficulty_step": 8, **extra}))
        assert (f"{where}.schedule_config.difficulty_step: the difficulties are multiples of it, so one must lie "
                "within [min_difficulty, max_difficulty] = [9, 15]; got 8, whose first multiple from min_difficulty "
                "on is 16") in text


def test_a_legacy_seqlen_of_zero_is_refused_at_parse_time() -> None:
    for schedule in (LINEAR, {**DISCRETE, "schedule_config": {"difficulty": [0, 16], "max_step": [5]}}):
        text = _error(_legacy(**{**schedule, "min_difficulty": 0}))
        assert "curriculum_learning.min_difficulty: the seqlen curriculum's difficulty is a sequence length, at " \
               "least 1; got 0." in text


def test_percentile_bounds() -> None:
    text = _error(_metric(**{**LINEAR, "difficulty_type": "percentile", "min_difficulty": -5}))
    assert (f'{METRIC_PATH}.min_difficulty: with difficulty_type "percentile" min_difficulty >= 0 and max_difficulty '
            "> 0 (the whole, 100 say) are required; got min_difficulty -5, max_difficulty 64.") in text


def test_levels_on_the_bounds_and_value_metrics_below_one_pass() -> None:
    ok = {**DISCRETE, "schedule_config": {"difficulty": [8, 12, 16], "max_step": [5, 10]}}
    assert parse_config({"train_micro_batch_size_per_gpu": 2, **_legacy(**ok)}).curriculum_learning is not None
    # a data-sampling metric's value may be 0 or negative (it is not a length)
    value = {**LINEAR, "min_difficulty": -8, "max_difficulty": 8}
    assert parse_config({"train_micro_batch_size_per_gpu": 2, **_metric(**value)}).data_efficiency.curriculum


def test_a_custom_schedule_giving_no_positions_is_refused_at_the_forward() -> None:
    class Plain(torch.nn.Module):
        def forward(self, input_ids):  # noqa: ANN001, ANN201
            return input_ids

    model = Plain().train()
    cut = SeqlenCurriculum(LegacyCurriculumConfig(enabled=True, min_difficulty=2, max_difficulty=6,
                                                  schedule_type="custom"), model)
    cut.scheduler.set_custom_get_difficulty(lambda step: 0)
    with pytest.raises(CurriculumError, match=r"curriculum_learning: the custom schedule gave sequence length 0 at "
                       r"step 1; at least 1 is required. Return a length within \[min_difficulty, max_difficulty\] = "
                       r"\[2, 6\]"):
        cut.prepare(model, 0, (torch.zeros(2, 6, dtype=torch.long),), {})
