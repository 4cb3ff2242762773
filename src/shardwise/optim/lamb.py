"""LAMB with DeepSpeed FusedLamb's parameters and numbers, in torch ops (any device).

Per parameter tensor, with g the gradient divided by the loss scale (and by the clip factor):

    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    u = m / (sqrt(v) + eps) + weight_decay * p      # sqrt(v + eps) when eps_inside_sqrt
    coeff = clamp(||p|| / ||u||, min_coeff, max_coeff), or 1 when either norm is 0
    p = p - step_size * coeff * u,   step_size = lr * sqrt(1 - beta2^t) / (1 - beta1^t)

As in DeepSpeed's kernel, m and v are *not* bias corrected inside u: the correction only scales
the step, after the trust ratio, so the ratio is taken on the uncorrected update. Weight decay is
part of u (and so of its norm), not decoupled.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Sequence

import torch

from ._scheduler_base import invalid_param

__all__ = ["Lamb"]

# Added to the unscaled gradient norm before comparing it with max_grad_norm, as DeepSpeed does.
_CLIP_EPS = 1e-6


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al., 2019, arXiv:1904.00962) as DeepSpeed's FusedLamb computes it.

    Args:
        params: parameters or param-group dicts.
        lr: learning rate.
        bias_correction: scale the step by ``sqrt(1 - beta2^t) / (1 - beta1^t)``.
        betas: decay rates of the gradient's first and second moments.
        eps: added to ``sqrt(v)`` (or to ``v`` under the root with ``eps_inside_sqrt``).
        eps_inside_sqrt: use ``sqrt(v + eps)`` as the denominator.
        weight_decay: L2 term added to the update before the trust ratio.
        max_grad_norm: when > 0, divide a group's gradients by ``norm / max_grad_norm`` if the
            (unscaled) norm of that group's gradients exceeds it.
        max_coeff, min_coeff: bounds of the trust ratio ``||p|| / ||update||``.
        amsgrad: not supported (as in DeepSpeed); must be False.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
    ) -> None:
        _check_hyperparameters(lr, betas, eps, weight_decay, max_grad_norm, max_coeff, min_coeff, amsgrad)
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)
        # Optimizer-wide, not per group, so param groups saved by DeepSpeed load unchanged.
        self.eps_inside_sqrt = eps_inside_sqrt
        self.lamb_coeffs: list[torch.Tensor] = []

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], Any] | None = None,
        scale: float = 1.0,
        grad_norms: Sequence[float | torch.Tensor | None] | None = None,
    ) -> Any:
        """One LAMB update of every parameter that has a gradient.

        Args:
            closure: re-evaluates the model and returns the loss.
            scale: the loss scale the gradients still carry; they are divided by it.
            grad_norms: per param group, the norm of its (still scaled) gradients, used only when
                ``max_grad_norm > 0``; computed from the gradients when not given.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.lamb_coeffs = []
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("Lamb: sparse gradients are not supported; use dense gradients.")
            grad_norm = grad_norms[index] if grad_norms is not None else None
            self._update_group(group, params, scale, grad_norm)
        return loss

    def _update_group(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        scale: float,
        grad_norm: float | torch.Tensor | None,
    ) -> None:
        beta1, beta2 = group["betas"]
        # Master weights may be fp32 under fp16/bf16 gradients: do the math in the weights' dtype.
        grads = [p.grad if p.grad.dtype == p.dtype else p.grad.to(p.dtype) for p in params]
        divisor = self._gradient_divisor(group, grads, scale, grad_norm)
        grads = torch._foreach_div(grads, divisor)  # a new list: p.grad itself stays untouched

        exp_avgs, exp_avg_sqs, steps = [], [], []
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])

        lamb_moments(exp_avgs, exp_avg_sqs, grads, beta1, beta2)
        updates = lamb_updates(group, params, exp_avgs, exp_avg_sqs, self.eps_inside_sqrt)
        self.lamb_coeffs.extend(apply_trust_ratio(group, params, updates, steps))

    @staticmethod
    def _gradient_divisor(
        group: dict[str, Any], grads: list[torch.Tensor], scale: float, grad_norm: float | torch.Tensor | None
    ) -> float | torch.Tensor:
        """The loss scale, times the clip factor when the group's unscaled gradient norm is too big."""
        max_norm = group["max_grad_norm"]
        if max_norm <= 0:
            return scale
        if grad_norm is None:
            # Kept as a tensor so that clipping needs no device-to-host sync.
            grad_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        clip = (grad_norm / scale + _CLIP_EPS) / max_norm
        if torch.is_tensor(clip):
            return torch.clamp(clip, min=1.0) * scale
        return clip * scale if clip > 1 else scale

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratio each parameter got in the last step, in param-group order."""
        return [coeff.item() for coeff in self.lamb_coeffs]


def lamb_moments(exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], grads: list[torch.Tensor],
                 beta1: float, beta2: float) -> None:
    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)


def lamb_updates(group: dict[str, Any], params: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                 exp_avg_sqs: list[torch.Tensor], eps_inside_sqrt: bool) -> list[torch.Tensor]:
    """u = m / (sqrt(v) + eps) + weight_decay * p, per parameter, as new tensors."""
    if eps_inside_sqrt:
        denoms = torch._foreach_sqrt(torch._foreach_add(exp_avg_sqs, group["eps"]))
    else:
        denoms = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_add_(denoms, group["eps"])
    updates = torch._foreach_div(exp_avgs, denoms)
    if group["weight_decay"] != 0:
        torch._foreach_add_(updates, params, alpha=group["weight_decay"])
    return updates


def apply_trust_ratio(group: dict[str, Any], params: list[torch.Tensor], updates: list[torch.Tensor],
                      steps: list[int]) -> list[torch.Tensor]:
    """p -= step_size * coeff * u with LAMB's trust ratio coeff (consumes `updates`); returns the coefficients."""
    weight_norms = torch._foreach_norm(params)
    update_norms = torch._foreach_norm(updates)
    coeffs = []
    for p, update, w_norm, u_norm, t in zip(params, updates, weight_norms, update_norms, steps):
        coeff = _trust_ratio(w_norm, u_norm, group["max_coeff"], group["min_coeff"])
        coeffs.append(coeff)
        p.sub_(update.mul_(coeff * lamb_step_size(group, t)))
    return coeffs


def _trust_ratio(w_norm: torch.Tensor, u_norm: torch.Tensor, max_coeff: float, min_coeff: float) -> torch.Tensor:
    ratio = torch.clamp(w_norm / u_norm, min=min_coeff, max=max_coeff)
    # A zero weight (fresh init) or zero update has no meaningful ratio: take the plain step.
    return torch.where((w_norm != 0) & (u_norm != 0), ratio, torch.ones_like(ratio))


def lamb_step_size(group: dict[str, Any], step: int, variance_steps: int | None = None) -> float:
    """lr * sqrt(1 - beta2^variance_steps) / (1 - beta1^step); `variance_steps` is `step` unless the variance froze."""
    lr = float(group["lr"])
    if not group["bias_correction"]:
        return lr
    beta1, beta2 = group["betas"]
    return lr * math.sqrt(1 - beta2 ** (step if variance_steps is None else variance_steps)) / (1 - beta1**step)


def _check_hyperparameters(
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    max_grad_norm: float,
    max_coeff: float,
    min_coeff: float,
    amsgrad: bool,
) -> None:
    if amsgrad:
        raise invalid_param(
            "amsgrad", "is not supported by Lamb (nor by DeepSpeed's FusedLamb)", amsgrad, "Remove it or set it false."
        )
    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay), ("max_grad_norm", max_grad_norm)):
        if value < 0:
            raise invalid_param(name, "must be >= 0", value, f"Set {name} to a non-negative number.")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise invalid_param("betas", "must be two numbers in [0, 1)", betas, "Use e.g. [0.9, 0.999].")
    if min_coeff < 0 or max_coeff < min_coeff:
        raise invalid_param(
            "max_coeff",
            f"must be >= min_coeff ({min_coeff}) and min_coeff >= 0",
            max_coeff,
            "Bound the trust ratio with 0 <= min_coeff <= max_coeff (defaults 0.01 and 10.0).",
        )
