"""Schedules: the difficulty (or kept-token count) at an optimizer step, as a pure function of the step.

Pure so that a resumed run needs nothing but the step to be where it was. The arithmetic follows
DeepSpeed's documented schedules (tests/compat checks them value for value against DeepSpeed 0.19.8):
- fixed_linear / fixed_root: min + (max - min) · (step / total_curriculum_step)^(1/root_degree), floored,
  rounded down to a multiple of `difficulty_step`, clamped to [min rounded up to that multiple, max];
- fixed_discrete: `difficulty[i]` while step <= `max_step[i]`, the last difficulty after the last max_step;
- random-LTD's fixed_linear: the same line over `require_steps` in multiples of `seq_per_step`, without the
  lower clamp (as DeepSpeed's random-LTD scheduler);
- custom: a function of the step the user sets (`engine.set_custom_curriculum_learning_schedule`).
"""

from __future__ import annotations

import math
from typing import Callable

from ..config.data_efficiency import CurriculumSchedule, RandomLTDSchedule


class DifficultySchedule:
    """`difficulty(step)` for a curriculum section; `custom` needs `set_custom(fn)` before the first step."""

    def __init__(self, config: CurriculumSchedule, name: str = "curriculum_learning"):
        self.config, self.name = config, name
        self._custom: Callable[[int], float] | None = None

    def set_custom(self, fn: Callable[[int], float]) -> None:
        self._custom = fn

    def difficulty(self, step: int) -> float:
        c, s = self.config, self.config.schedule_config
        if c.schedule_type == "fixed_discrete":
            assert s.difficulty is not None and s.max_step is not None  # checked by the config
            return next((d for d, end in zip(s.difficulty, s.max_step) if step <= end), s.difficulty[-1])
        if c.schedule_type == "custom":
            if self._custom is None:
                raise RuntimeError(f"{self.name}: schedule_type \"custom\" needs a schedule function; none was set. Call "
                                   "engine.set_custom_curriculum_learning_schedule({metric: fn}) before training.")
            return self._custom(step)
        root = 1.0 if c.schedule_type == "fixed_linear" else s.root_degree
        assert s.total_curriculum_step is not None and s.difficulty_step is not None and root is not None
        value = _rooted_line(step, s.total_curriculum_step, root, c.min_difficulty, c.max_difficulty, s.difficulty_step)
        lowest = math.ceil(c.min_difficulty / s.difficulty_step) * s.difficulty_step
        return min(max(value, lowest), c.max_difficulty)


def kept_tokens(schedule: RandomLTDSchedule, step: int) -> int:
    """Tokens a random-LTD layer keeps at optimizer step `step`."""
    s = schedule.schedule_config
    value = _rooted_line(step, s.require_steps, 1.0, schedule.min_value, schedule.max_value, s.seq_per_step)
    return int(min(value, schedule.max_value))


def _rooted_line(step: int, total: int, root: float, low: float, high: float, multiple: int) -> float:
    value = math.floor((step / total) ** (1.0 / root) * (high - low) + low)
    return value - value % multiple
