"""`optimizer` and `scheduler`: which class, by DeepSpeed's rules for names; `optim/registry.py` builds it
and checks `params` against its arguments."""

from __future__ import annotations

import difflib
from typing import Any

import torch
from pydantic import Field, field_validator

from .base import Section

COMPRESSED_OPTIMIZER_NAMES = ("onebitadam", "zerooneadam", "onebitlamb")
"""DeepSpeed's communication-compressed optimizers (`optim/onebit/`, the lower case of its class names)."""
OPTIMIZER_NAMES = ("adam", "adamw", "sgd", "lamb", "lion", "adagrad", *COMPRESSED_OPTIMIZER_NAMES)
SCHEDULER_NAMES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
_NOT_IMPLEMENTED_OPTIMIZERS = ("muon", "muadam", "muadamw", "musgd")  # DeepSpeed's Muon and mup optimizers


class OptimizerConfig(Section):
    """`type`: one of DeepSpeed's names (any case) or the name of a torch.optim class (its exact case, as
    DeepSpeed looks it up); `optim/registry.py` builds it and checks `params` against its arguments."""

    type: str
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("type")
    @classmethod
    def _known(cls, value: str) -> str:
        if value.lower() in OPTIMIZER_NAMES:
            return value.lower()
        if value.lower() in _NOT_IMPLEMENTED_OPTIMIZERS:
            raise ValueError(f"optimizer.type: a DeepSpeed setting that shardwise does not implement yet ({value}); "
                             f"got {value!r}. Use one of {', '.join(OPTIMIZER_NAMES)} or a torch.optim class.")
        found = getattr(torch.optim, value, None)
        if isinstance(found, type) and issubclass(found, torch.optim.Optimizer):
            return value
        torch_names = [n for n, c in vars(torch.optim).items() if isinstance(c, type) and issubclass(c, torch.optim.Optimizer)]
        raise ValueError(f"optimizer.type: must be one of {', '.join(OPTIMIZER_NAMES)} (any case) or a torch.optim "
                         f"class name; got {value!r}.{_did_you_mean(value, [*torch_names, *OPTIMIZER_NAMES])}")


class SchedulerConfig(Section):
    """`type`: one of DeepSpeed's schedules or a torch.optim.lr_scheduler class (exact case, as DeepSpeed)."""

    type: str
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("type")
    @classmethod
    def _known(cls, value: str) -> str:
        found = getattr(torch.optim.lr_scheduler, value, None)
        if value in SCHEDULER_NAMES or (isinstance(found, type) and hasattr(found, "step") and not value.startswith("_")):
            return value
        raise ValueError(f"scheduler.type: must be one of {', '.join(SCHEDULER_NAMES)} or a torch.optim.lr_scheduler "
                         f"class name; got {value!r}.{_did_you_mean(value, list(SCHEDULER_NAMES))}")


def _did_you_mean(value: str, choices: list[str]) -> str:
    by_lower = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(value.lower(), list(by_lower), n=1, cutoff=0.6)
    return f" Did you mean '{by_lower[close[0]]}'?" if close else ""
