"""Build the optimizer and the scheduler named in the config.

DeepSpeed's names and semantics: "Adam" is Adam with decoupled weight decay (AdamW) unless
`adam_w_mode` is false; its own names are case-insensitive; any other name is looked up in torch.optim
(optimizers) or torch.optim.lr_scheduler (schedulers), case-sensitively, as DeepSpeed does. Adam/AdamW
use torch's fused kernels (CPU and CUDA), the fastest torch ships; the math is torch's own.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any, Iterable

import torch

from ..config import ConfigError, OptimizerConfig, SchedulerConfig
from ..config.training import COMPRESSED_OPTIMIZER_NAMES
from .arguments import argument_problems

# DeepSpeed keys that select an implementation, not the math; accepted and not needed here.
_ADAM_IMPLEMENTATION_KEYS = {"torch_adam", "fused", "foreach", "adam_w_mode", "bias_correction"}
_LION_IMPLEMENTATION_KEYS = {"set_grad_none", "fp32_optimizer_states"}  # FusedLion, DeepSpeedCPULion


def optimizer_class(name: str, params: dict[str, Any]) -> type[torch.optim.Optimizer]:
    """The class for a config's optimizer `type` (already validated by OptimizerConfig)."""
    lowered = name.lower()
    if lowered == "adam":
        return torch.optim.AdamW if params.get("adam_w_mode", True) else torch.optim.Adam
    if lowered == "adamw":
        return torch.optim.AdamW
    if lowered == "sgd":
        return torch.optim.SGD
    if lowered == "adagrad":
        return torch.optim.Adagrad
    if lowered == "lamb":
        from .lamb import Lamb

        return Lamb
    if lowered == "lion":
        from .lion import Lion

        return Lion
    if lowered in COMPRESSED_OPTIMIZER_NAMES:
        from . import onebit

        return next(getattr(onebit, n) for n in onebit.__all__ if n.lower() == lowered)
    return getattr(torch.optim, name)


def _implementation_keys(cls: type) -> set[str]:
    from .lion import Lion

    if cls in (torch.optim.Adam, torch.optim.AdamW):
        return _ADAM_IMPLEMENTATION_KEYS
    return _LION_IMPLEMENTATION_KEYS if cls is Lion else set()


def _check_params(cls: type, params: dict[str, Any], where: str = "optimizer.params") -> None:
    allowed = {n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "params", "optimizer")}
    allowed |= _implementation_keys(cls)
    problems = []
    for key in params:
        if key not in allowed:
            close = difflib.get_close_matches(key, sorted(allowed), n=1)
            hint = f"Did you mean '{close[0]}'? " if close else ""
            problems.append(f"{where}.{key}: unknown for {cls.__name__}. {hint}Allowed: {', '.join(sorted(allowed))}.")
    problems += argument_problems(where, cls, params)
    if cls in (torch.optim.Adam, torch.optim.AdamW) and params.get("bias_correction", True) is not True:
        problems.append("optimizer.params.bias_correction: only true is supported; got false. Remove the key.")
    if problems:
        raise ConfigError(problems)


def check_optimizer(cfg: OptimizerConfig) -> None:
    """Raise a ConfigError listing every parameter that does not fit the optimizer (before any is built)."""
    _check_params(optimizer_class(cfg.type, cfg.params), dict(cfg.params))


def build_optimizer(cfg: OptimizerConfig, param_groups: Iterable[dict[str, Any]]) -> torch.optim.Optimizer:
    params = dict(cfg.params)
    cls = optimizer_class(cfg.type, params)
    _check_params(cls, params)
    kwargs = {k: v for k, v in params.items() if k not in _implementation_keys(cls)}
    if cls in (torch.optim.Adam, torch.optim.AdamW):
        kwargs["fused"] = True
        if not params.get("torch_adam", False):
            kwargs.setdefault("weight_decay", 0.0)  # DeepSpeed's fused Adam defaults to 0 (torch's AdamW to 0.01)
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    try:
        return cls(list(param_groups), **kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError([f"optimizer.params: {cfg.type} rejected {params}: {e}"]) from e


def scheduler_class(name: str) -> type:
    from .schedulers import SCHEDULERS

    return SCHEDULERS[name] if name in SCHEDULERS else getattr(torch.optim.lr_scheduler, name)


def check_scheduler(cfg: SchedulerConfig) -> None:
    """Raise a ConfigError listing every parameter that does not fit the scheduler."""
    _check_params(scheduler_class(cfg.type), dict(cfg.params), "scheduler.params")


def build_scheduler(cfg: SchedulerConfig, optimizer: torch.optim.Optimizer) -> Any:
    check_scheduler(cfg)
    try:
        return scheduler_class(cfg.type)(optimizer, **cfg.params)
    except TypeError as e:
        raise ConfigError([f"scheduler.params: {cfg.type} rejected {cfg.params}: {e}"]) from e
