"""Difficulty schedules (pure functions of the step), the curriculum config's errors, and the legacy seqlen
curriculum's cut of a forward's arguments (no process group)."""

from __future__ import annotations

import pytest
import torch

from shardwise.config import ConfigError, parse_config
from shardwise.config.data_efficiency import CurriculumSchedule, LegacyCurriculumConfig
from shardwise.data_efficiency import CurriculumError, DifficultySchedule
from shardwise.data_efficiency.seqlen import SeqlenCurriculum


def schedule(kind: str, lo: float = 8, hi: float = 64, **cfg: object) -> DifficultySchedule:
    return DifficultySchedule(CurriculumSchedule(min_difficulty=lo, max_difficulty=hi, schedule_type=kind,
                                                 schedule_config=cfg))


def test_fixed_linear_values() -> None:
    s = schedule("fixed_linear", total_curriculum_step=10, difficulty_step=8)
    # 8 + 56 * step / 10, floored, down to a multiple of 8, at least 8, at most 64
    assert [s.difficulty(k) for k in (0, 1, 2, 3, 5, 9, 10, 11, 1000)] == [8, 8, 16, 24, 32, 56, 64, 64, 64]


def test_fixed_root_values_and_step_not_dividing_min() -> None:
    s = schedule("fixed_root", lo=5, hi=30, total_curriculum_step=16, difficulty_step=4, root_degree=2)
    # 5 + 25 * sqrt(step / 16): 5, 11.25, 17.5, 23.75, 30 -> multiples of 4, floor raised to 8 (ceil(5/4)*4);
    # 30 itself rounds down to 28 at the last step (as in DeepSpeed); past the end the line overshoots to the max
    assert [s.difficulty(k) for k in (0, 1, 4, 9, 16, 40)] == [8, 8, 16, 20, 28, 30]


def test_fixed_discrete_values() -> None:
    s = schedule("fixed_discrete", lo=1, hi=3, difficulty=[1, 2, 3], max_step=[5, 10])
    assert [s.difficulty(k) for k in (0, 5, 6, 10, 11, 99)] == [1, 1, 2, 2, 3, 3]


def test_custom_needs_a_function() -> None:
    s = schedule("custom", lo=1, hi=9)
    with pytest.raises(RuntimeError, match=r"custom\" needs a schedule function; none was set. Call "
                       r"engine.set_custom_curriculum_learning_schedule"):
        s.difficulty(1)
    s.set_custom(lambda step: step * 2)
    assert s.difficulty(3) == 6


METRIC = {"min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_root",
          "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8}}


@pytest.mark.parametrize("raw, message", [
    ({"curriculum_learning": {"enabled": True, **METRIC}},
     "curriculum_learning.schedule_config: schedule_type 'fixed_root' needs root_degree; got "
     "{'total_curriculum_step': 10, 'difficulty_step': 8}. Add them"),
    ({"curriculum_learning": {"enabled": True, **METRIC, "min_difficulty": 80, "schedule_type": "fixed_linear"}},
     "curriculum_learning.min_difficulty: must not exceed max_difficulty (64); got 80. Swap them."),
    ({"curriculum_learning": {"enabled": True, "min_difficulty": 1, "max_difficulty": 3,
                              "schedule_type": "fixed_discrete", "schedule_config": {"difficulty": [1, 2, 3],
                                                                                     "max_step": [5]}}},
     "curriculum_learning.schedule_config: fixed_discrete needs one more difficulty than max_step"),
    ({"curriculum_learning": {"enabled": True, **METRIC, "schedule_type": "fixed_cubic"}},
     "curriculum_learning.schedule_type: must be one of fixed_linear, fixed_root, fixed_discrete, custom; got "
     "'fixed_cubic'"),
    ({"data_efficiency": {"enabled": True, "data_sampling": {"enabled": True,
                                                             "curriculum_learning": {"enabled": True}}}},
     "data_efficiency.data_sampling.curriculum_learning.curriculum_metrics: curriculum learning needs at least one "
     "metric; got none."),
    ({"data_efficiency": {"data_sampling": {"curriculum_learning": {"curriculum_metrics": {"seqlen": METRIC}}}}},
     "data_efficiency.data_sampling.curriculum_learning.curriculum_metrics.seqlen.schedule_config: schedule_type "
     "'fixed_root' needs root_degree"),
])  # fmt: skip
def test_config_errors(raw: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"train_micro_batch_size_per_gpu": 2, **raw})
    assert message in str(info.value)


def test_disabled_legacy_section_needs_no_schedule() -> None:
    assert parse_config({"train_micro_batch_size_per_gpu": 2, "curriculum_learning": {"enabled": False}}
                        ).curriculum_learning is None


LEGACY = LegacyCurriculumConfig(enabled=True, min_difficulty=2, max_difficulty=6, schedule_type="fixed_linear",
                                schedule_config={"total_curriculum_step": 4, "difficulty_step": 2})


class Plain(torch.nn.Module):
    def forward(self, input_ids, attention_mask=None, labels=None):  # noqa: ANN001, ANN201
        return input_ids


class Megatron(torch.nn.Module):
    def forward(self, tokens, curriculum_seqlen=None):  # noqa: ANN001, ANN201
        return tokens


def test_cut_of_the_sequence_tensors() -> None:
    model = Plain().train()
    cut = SeqlenCurriculum(LEGACY, model)
    ids, emb, flat = torch.arange(12).reshape(2, 6), torch.randn(2, 6, 3), torch.tensor([1, 2])
    args, kw = cut.prepare(model, 1, (ids,), {"attention_mask": torch.ones(2, 6), "labels": ids, "embeds": emb,
                                              "weights": flat, "other": torch.zeros(2, 4), "name": "x"})
    # step 2 of 4: 2 + 4 * 2/4 = 4 positions
    assert args[0].tolist() == [[0, 1, 2, 3], [6, 7, 8, 9]]
    assert kw["attention_mask"].shape == (2, 4) and kw["labels"].shape == (2, 4) and kw["embeds"].shape == (2, 4, 3)
    assert kw["weights"] is flat and kw["other"].shape == (2, 4) and kw["name"] == "x"
    assert cut.scheduler.get_current_difficulty() == 4
    full, _ = cut.prepare(model, 10, (ids,), {})  # past the end: the whole sequence
    assert full[0].shape == (2, 6)
    model.eval()
    same, _ = cut.prepare(model, 0, (ids,), {})
    assert same[0].shape == (2, 6)


def test_a_model_with_curriculum_seqlen_gets_the_kwarg() -> None:
    model = Megatron().train()
    ids = torch.zeros(2, 6, dtype=torch.long)
    args, kw = SeqlenCurriculum(LEGACY, model).prepare(model, 0, (ids,), {})
    assert args[0] is ids and kw == {"curriculum_seqlen": 2}


def test_refusals() -> None:
    model = Plain().train()
    cut = SeqlenCurriculum(LEGACY, model)
    with pytest.raises(CurriculumError, match=r"curriculum_learning: the seqlen curriculum needs the token ids as "
                       r"an integer tensor of shape \(batch, sequence, ...\) among the forward's arguments; got "
                       r"\(torch.float32 tensor \(2, 6\)\)"):
        cut.prepare(model, 0, (torch.zeros(2, 6),), {})
    with pytest.raises(CurriculumError, match=r"curriculum_learning: cannot tell which dim of argument "
                       r"attention_mask \(shape \(2, 1, 6, 6\)\) is the sequence of length 6"):
        cut.prepare(model, 0, (torch.zeros(2, 6, dtype=torch.long),), {"attention_mask": torch.ones(2, 1, 6, 6)})


def test_compat_curriculum_scheduler_and_analyzer() -> None:
    import deepspeed

    from tests.reference import is_compat

    if not is_compat(deepspeed):
        pytest.skip("the real DeepSpeed is installed here; tests/unit/test_deepspeed_parity_curriculum.py compares")
    from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler
    from deepspeed.runtime.data_pipeline.data_sampling.data_analyzer import DataAnalyzer

    from shardwise.data_efficiency import DataAnalyzer as Ours

    s = CurriculumScheduler({"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 2, "max_difficulty": 6,
                             "schedule_type": "fixed_discrete", "schedule_config": {"difficulty": [2, 6],
                                                                                    "max_step": [3]}})
    assert [s.update_difficulty(k) for k in (1, 3, 4, 5)] == [2, 2, 6, 6] and s.get_current_difficulty() == 6
    assert s.state_dict()["current_difficulty"] == 6 and DataAnalyzer is Ours
