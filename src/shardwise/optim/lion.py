"""Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms", arXiv:2302.06675), with
DeepSpeed's `Lion` parameters and defaults. torch ships no Lion.

Per parameter, with g the (unscaled, clipped) gradient and the paper's decoupled weight decay:

    c = beta1 * m + (1 - beta1) * g
    p = p - lr * (sign(c) + weight_decay * p)
    m = beta2 * m + (1 - beta2) * g

One state tensor (m) per parameter, in the parameter's dtype. sign(0) is 0 as in the paper and
torch.sign; DeepSpeed's kernels step by -lr (CUDA) or by the sign bit of +-0 (CPU) where c is exactly
zero, which only a gradient and momentum of exactly zero produce.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

__all__ = ["Lion"]


class Lion(torch.optim.Optimizer):
    """Lion: the sign of an interpolated momentum as the update.

    Args:
        params: parameters or param-group dicts.
        lr: learning rate (Lion wants one 3-10x smaller than AdamW's, and weight decay that much larger).
        betas: (beta1, beta2): the interpolation for the update, and the momentum's decay.
        weight_decay: decoupled: each step scales p by (1 - lr * weight_decay).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
    ) -> None:
        if not 0.0 <= lr:
            raise ValueError(f"Lion lr: must be >= 0; got {lr}.")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Lion betas: each must be in [0, 1); got {tuple(betas)}.")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Lion weight_decay: must be >= 0; got {weight_decay}.")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, decay = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lion: sparse gradients are not supported.")
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                momentum = state["exp_avg"]
                update = torch.lerp(p.grad, momentum, beta1).sign_()  # beta1 * m + (1 - beta1) * g
                if decay != 0:
                    p.mul_(1 - lr * decay)
                p.add_(update, alpha=-lr)
                momentum.lerp_(p.grad, 1 - beta2)  # beta2 * m + (1 - beta2) * g
        return loss
