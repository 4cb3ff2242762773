"""Build the optimizer named in the config over the strategy's parameter groups.

DeepSpeed's names and semantics: "Adam" is Adam with decoupled weight decay (AdamW) unless
`adam_w_mode` is false; names are case-insensitive. Adam/AdamW use torch's fused kernels (CPU and
CUDA), which are the fastest torch ships; the math is torch's own.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any, Iterable

import torch

from ..config import ConfigError, OptimizerConfig

# DeepSpeed keys that select an implementation, not the math; accepted and not needed here.
_IMPLEMENTATION_KEYS = {"torch_adam", "fused", "foreach", "adam_w_mode", "bias_correction"}


def _optimizer_class(name: str, params: dict[str, Any]) -> type[torch.optim.Optimizer]:
    if name == "adam":
        return torch.optim.AdamW if params.get("adam_w_mode", True) else torch.optim.Adam
    if name == "adamw":
        return torch.optim.AdamW
    if name == "sgd":
        return torch.optim.SGD
    if name == "adagrad":
        return torch.optim.Adagrad
    from .lamb import Lamb

    return Lamb


def _check_params(cls: type, params: dict[str, Any]) -> None:
    is_adam = cls in (torch.optim.Adam, torch.optim.AdamW)
    allowed = {n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "params")}
    allowed |= _IMPLEMENTATION_KEYS if is_adam else set()
    problems = []
    for key in params:
        if key not in allowed:
            close = difflib.get_close_matches(key, sorted(allowed), n=1)
            hint = f"Did you mean '{close[0]}'? " if close else ""
            problems.append(f"optimizer.params.{key}: unknown for {cls.__name__}. {hint}Allowed: {', '.join(sorted(allowed))}.")
    if is_adam and params.get("bias_correction", True) is not True:
        problems.append("optimizer.params.bias_correction: only true is supported; got false. Remove the key.")
    if problems:
        raise ConfigError(problems)


def build_optimizer(cfg: OptimizerConfig, param_groups: Iterable[dict[str, Any]]) -> torch.optim.Optimizer:
    params = dict(cfg.params)
    cls = _optimizer_class(cfg.type, params)
    _check_params(cls, params)
    kwargs = dict(params)
    if cls in (torch.optim.Adam, torch.optim.AdamW):
        kwargs = {k: v for k, v in params.items() if k not in _IMPLEMENTATION_KEYS}
        kwargs["fused"] = True
        if not params.get("torch_adam", False):
            kwargs.setdefault("weight_decay", 0.0)  # DeepSpeed's fused Adam defaults to 0 (torch's AdamW to 0.01)
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    try:
        return cls(list(param_groups), **kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError([f"optimizer.params: {cfg.type} rejected {params}: {e}"]) from e
