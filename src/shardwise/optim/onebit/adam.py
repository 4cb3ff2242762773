"""1-bit Adam (Tang et al., 2021, arXiv:2102.02888) with DeepSpeed's `OneBitAdam` parameters.

Steps 1..freeze_step are Adam with decoupled weight decay (DeepSpeed's default "Adam"), on gradients the
strategy averaged exactly. Adam's variance becomes stable early in training, so from then on it is frozen,
and only the momentum needs to be shared; each rank updates the momentum with its own gradient and the ranks
average the momentum in 1 bit with error feedback (`CompressedAllReduce`). The update keeps Adam's form with
the frozen variance and its bias correction at the freeze.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from ._checks import check_adam_arguments
from .base import CompressedOptimizer

__all__ = ["OneBitAdam"]


class OneBitAdam(CompressedOptimizer):
    """Args as DeepSpeed's: lr, freeze_step (exact Adam steps before compression), betas, eps, weight_decay
    (decoupled, as AdamW), bias_correction, amsgrad (refused), cuda_aware and comm_backend_name (accepted:
    shardwise sends through the engine's process group), max_grad_norm and eps_inside_sqrt (0 / False only)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, freeze_step: int = 100000,
                 bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0, max_grad_norm: float = 0.0,
                 amsgrad: bool = False, cuda_aware: bool = False, comm_backend_name: str = "nccl"):
        check_adam_arguments(type(self).__name__, lr, betas, eps, weight_decay, max_grad_norm, amsgrad,
                             eps_inside_sqrt, {"freeze_step": freeze_step})
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        super().__init__(params, defaults, cuda_aware, comm_backend_name)
        self.freeze_step = freeze_step

    def _take_step(self, step: int) -> None:
        warm = step <= self.freeze_step
        for group in self.param_groups:
            self._adam_moments(group, self._grads(group["params"]), variance=warm)
        if not warm:
            self._compressed_mean(self.flat["exp_avg"])
        for group in self.param_groups:
            params = group["params"]
            if group["weight_decay"] != 0:
                torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
            denoms = self._adam_denominators(group, min(step, self.freeze_step))
            torch._foreach_addcdiv_(params, [self.state[p]["exp_avg"] for p in params], denoms,
                                    value=-self._adam_step_size(group, step))
