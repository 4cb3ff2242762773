"""The legacy sequence-length curriculum (`curriculum_learning` with `curriculum_type: seqlen`).

At every training forward the model sees only the first `difficulty(global_steps + 1)` positions of each
sequence. DeepSpeed's engine passed `curriculum_seqlen=<difficulty>` to the model and left the cut to the
model (Megatron's GPT truncates itself); a model whose forward takes `curriculum_seqlen` gets exactly that
here. Any other model (a Hugging Face one) gets its batch truncated for it, see [Note: which tensors are
sequences]. In eval mode (`module.training` false) the whole sequence is used, as in DeepSpeed.

The difficulty is a pure function of the optimizer step, so a resumed run cuts exactly as the
uninterrupted one would: nothing but `global_steps` needs to be in the checkpoint.

[Note: which tensors are sequences] The sequence length L is dim 1 of the first integer tensor with at least
two dims among the forward's arguments (positional first, then keywords, one level into dicts, lists and
tuples: the token ids). Every tensor with at least two dims whose dim 1 is L is cut along dim 1 (input_ids,
attention_mask, labels, position_ids, token_type_ids, inputs_embeds). A tensor that has L in any later dim
(a 4-D attention mask (B, 1, L, L), a (B, H, L) tensor) cannot be cut safely by position, so the forward is
refused rather than run on a half-cut batch; a batch with no integer tensor of two or more dims is refused
too. Training silently on the whole sequence would look like a working curriculum and not be one.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..config.data_efficiency import CurriculumSchedule, LegacyCurriculumConfig
from .schedule import DifficultySchedule


class CurriculumError(ValueError):
    """A batch or model the configured curriculum cannot act on."""


class LegacyCurriculumScheduler:
    """DeepSpeed's `CurriculumScheduler` API (`engine.curriculum_scheduler_legacy`, and
    `deepspeed.runtime.data_pipeline.curriculum_scheduler` in compat): built from a typed schedule section or
    DeepSpeed's section dict. `update_difficulty` keeps DeepSpeed's rule that the difficulty stops changing
    once it has reached max_difficulty; the engine reads `difficulty(step)` itself, a pure function of the step."""

    def __init__(self, config: CurriculumSchedule | dict[str, Any]):
        if isinstance(config, dict):
            config = CurriculumSchedule.model_validate({k: v for k, v in config.items() if k in _SCHEDULE_KEYS})
        self.config = config
        self.schedule = DifficultySchedule(config, "curriculum_learning")
        self.current_difficulty = config.min_difficulty

    def update_difficulty(self, step: int) -> float:
        if self.current_difficulty < self.config.max_difficulty:
            self.current_difficulty = self.schedule.difficulty(step)
        return self.current_difficulty

    def get_difficulty(self, step: int) -> float:
        return self.schedule.difficulty(step)

    def get_current_difficulty(self) -> float:
        return self.current_difficulty

    def set_current_difficulty(self, difficulty: float) -> None:
        self.current_difficulty = difficulty

    def set_custom_get_difficulty(self, fn: Any) -> None:
        self.schedule.set_custom(fn)

    def get_state(self) -> dict[str, Any]:
        return self.state_dict()

    def state_dict(self) -> dict[str, Any]:
        return {**self.config.model_dump(exclude_none=True), "current_difficulty": self.current_difficulty}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.current_difficulty = state["current_difficulty"]


_SCHEDULE_KEYS = ("min_difficulty", "max_difficulty", "schedule_type", "schedule_config")


class SeqlenCurriculum:
    """Applies the legacy seqlen curriculum to one forward's arguments."""

    def __init__(self, config: LegacyCurriculumConfig, module: torch.nn.Module):
        self.config = config
        self.scheduler = LegacyCurriculumScheduler(config)
        self.passes_kwarg = _accepts(module, "curriculum_seqlen")

    def prepare(self, module: torch.nn.Module, global_steps: int, inputs: tuple[Any, ...],
                kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The forward's arguments for training step `global_steps + 1` (unchanged in eval mode)."""
        if not module.training:
            return inputs, kwargs
        length = int(self.scheduler.get_difficulty(global_steps + 1))
        if length < 1:  # only a custom schedule gets here: the config bounds the others
            raise CurriculumError(f"curriculum_learning: the custom schedule gave sequence length {length} at step "
                                  f"{global_steps + 1}; at least 1 is required. Return a length within "
                                  f"[min_difficulty, max_difficulty] = [{self.config.min_difficulty}, "
                                  f"{self.config.max_difficulty}].")
        self.scheduler.set_current_difficulty(length)
        if self.passes_kwarg:
            return inputs, {**kwargs, "curriculum_seqlen": length}
        full = _sequence_length((inputs, kwargs))
        if full is None:
            raise CurriculumError(
                "curriculum_learning: the seqlen curriculum needs the token ids as an integer tensor of shape "
                f"(batch, sequence, ...) among the forward's arguments; got {_describe(inputs, kwargs)}. Pass the "
                "token ids as a tensor, give the model's forward a `curriculum_seqlen` argument and cut the "
                "sequence there, or disable curriculum_learning.")
        if length >= full:
            return inputs, kwargs
        return (tuple(_cut(v, full, length, f"args[{i}]") for i, v in enumerate(inputs)),
                {k: _cut(v, full, length, k) for k, v in kwargs.items()})


def _accepts(module: torch.nn.Module, name: str) -> bool:
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _sequence_length(obj: Any) -> int | None:
    for t in _tensors(obj):
        if t.dim() >= 2 and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool:
            return int(t.shape[1])
    return None


def _cut(obj: Any, full: int, length: int, where: str) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.dim() < 2:
            return obj
        if full in obj.shape[2:]:
            raise CurriculumError(
                f"curriculum_learning: cannot tell which dim of argument {where} (shape "
                f"{tuple(obj.shape)}) is the sequence of length {full}, so the seqlen curriculum cannot cut it. Pass "
                "a 2-D attention mask (batch, sequence), give the model's forward a `curriculum_seqlen` argument and "
                "cut the sequence there, or disable curriculum_learning.")
        return obj[:, :length] if obj.shape[1] == full else obj
    if isinstance(obj, dict):
        return {k: _cut(v, full, length, _join(where, k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cut(v, full, length, _join(where, str(i))) for i, v in enumerate(obj))
    return obj


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _describe(inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    def one(v: Any) -> str:
        return f"{v.dtype} tensor {tuple(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__

    parts = [one(v) for v in inputs] + [f"{k}={one(v)}" for k, v in kwargs.items()]
    return "(" + ", ".join(parts) + ")"
