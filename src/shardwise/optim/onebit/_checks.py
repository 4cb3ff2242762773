"""Argument checks the compressed optimizers share, in the registry's error shape."""

from __future__ import annotations

from typing import Any

from .._scheduler_base import invalid_param


def check_adam_arguments(name: str, lr: float, betas: Any, eps: float, weight_decay: float, max_grad_norm: float,
                         amsgrad: bool, eps_inside_sqrt: bool, steps: dict[str, int]) -> None:
    if amsgrad:
        raise invalid_param("amsgrad", f"is not supported by {name} (nor by DeepSpeed's)", amsgrad, "Remove it.")
    if eps_inside_sqrt:
        raise invalid_param("eps_inside_sqrt", f"only false is supported by {name}", eps_inside_sqrt, "Remove it.")
    if max_grad_norm:
        raise invalid_param("max_grad_norm", f"only 0 is supported by {name} (DeepSpeed ignores it)", max_grad_norm,
                            'Clip with the config\'s "gradient_clipping" instead.')
    for key, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        if value < 0:
            raise invalid_param(key, "must be >= 0", value, f"Set {key} to a non-negative number.")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise invalid_param("betas", "must be two numbers in [0, 1)", betas, "Use e.g. [0.9, 0.999].")
    for key, value in steps.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise invalid_param(key, "must be a whole number of steps >= 1 (the variance needs at least one exact "
                                "step before it can be frozen)", value, f"Set {key} to e.g. 1000.")
