"""1-bit LAMB (Li et al., 2021, arXiv:2104.06069) with DeepSpeed's `OneBitLamb` parameters.

Steps 1..freeze_step are shardwise's `Lamb` (DeepSpeed FusedLamb's numbers) on exactly averaged gradients,
while an average of each parameter's trust ratio is kept (`coeff_beta`). Then the variance is frozen and the
momentum travels in 1 bit (`CompressedAllReduce`), each parameter's momentum first scaled to a common
magnitude (fixed at the freeze) so that the per-block scales fit every parameter. LAMB's trust ratio needs
the whole update, which compression blurs, so it is frozen too and only adjusted: a fresh variance is kept
from gradients reconstructed from consecutive momenta, and the ratio of the frozen denominator to the fresh
one (bounded by `factor_min`/`factor_max`, and by `factor_threshold` per step) scales the frozen coefficient.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from .._scheduler_base import invalid_param
from ..lamb import apply_trust_ratio, lamb_moments, lamb_step_size, lamb_updates
from ._checks import check_adam_arguments
from .base import CompressedOptimizer, frozen_denominators

__all__ = ["OneBitLamb"]


class OneBitLamb(CompressedOptimizer):
    """Args as DeepSpeed's: lr, freeze_step, betas, eps, weight_decay (inside the update, as LAMB), bias_correction,
    max_coeff, min_coeff, coeff_beta, factor_max, factor_min, factor_threshold; amsgrad refused; cuda_aware and
    comm_backend_name accepted (shardwise sends through the engine's process group)."""

    flat_keys = ("exp_avg", "exp_avg_sq", "exp_avg_sq_fresh")

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, freeze_step: int = 100000, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, max_coeff: float = 10.0,
                 min_coeff: float = 0.01, amsgrad: bool = False, cuda_aware: bool = False,
                 comm_backend_name: str = "nccl", coeff_beta: float = 0.9, factor_max: float = 4.0,
                 factor_min: float = 0.5, factor_threshold: float = 0.1):
        check_adam_arguments(type(self).__name__, lr, betas, eps, weight_decay, max_grad_norm, amsgrad, eps_inside_sqrt,
                             {"freeze_step": freeze_step})
        if not 0 <= min_coeff <= max_coeff or not 0 < factor_min <= 1 <= factor_max or not 0 <= coeff_beta < 1:
            raise invalid_param("max_coeff/min_coeff/factor_min/factor_max/coeff_beta",
                                "0 <= min_coeff <= max_coeff, 0 < factor_min <= 1 <= factor_max and 0 <= coeff_beta < 1",
                                (max_coeff, min_coeff, factor_min, factor_max, coeff_beta), "Use DeepSpeed's defaults.")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
                        max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults, cuda_aware, comm_backend_name)
        self.freeze_step, self.coeff_beta = freeze_step, coeff_beta
        self.factor_min, self.factor_max, self.factor_threshold = factor_min, factor_max, factor_threshold
        count = len(self._params)
        self.coeffs = {"frozen": torch.zeros(count), "averaged": torch.zeros(count), "last_factor": torch.ones(count),
                       "scaling": torch.zeros(count)}
        """Per parameter: the trust ratio's running average and how many ratios it holds, the last adjusting factor,
        and the momentum's scale (0 until the first compressed step sets it). The same on every rank."""
        self.lamb_coeffs: list[torch.Tensor] = []

    def _take_step(self, step: int) -> None:
        if step <= self.freeze_step:
            self._warm_step(step)
        else:
            self._compressed_step(step)

    def _warm_step(self, step: int) -> None:
        ratios: list[torch.Tensor] = []
        for group, _ in self.groups():
            params = group["params"]
            moments = [self.state[p]["exp_avg"] for p in params]
            variances = [self.state[p]["exp_avg_sq"] for p in params]
            lamb_moments(moments, variances, self._grads(params), *group["betas"])
            updates = lamb_updates(group, params, moments, variances, eps_inside_sqrt=False)
            ratios += apply_trust_ratio(group, params, updates, [step] * len(params))
        self.lamb_coeffs = ratios
        ratio, frozen, averaged = torch.stack(ratios), self.coeffs["frozen"], self.coeffs["averaged"]
        # A ratio of exactly 1 is the no-ratio case (a zero weight or update): it says nothing, as in DeepSpeed.
        counts = ratio != 1.0
        frozen.copy_(torch.where(counts, self.coeff_beta * frozen + (1 - self.coeff_beta) * ratio, frozen))
        averaged.add_(counts.float())
        if step == self.freeze_step:
            self.flat["exp_avg_sq_fresh"].copy_(self.flat["exp_avg_sq"])

    def _compressed_step(self, step: int) -> None:
        moments = [self.state[p]["exp_avg"] for p in self._params]
        if not bool(self.coeffs["scaling"].any()):
            self._set_scaling(moments)
        previous = self.views(self.flat["exp_avg"].clone())
        for group, part in self.groups():
            torch._foreach_lerp_(moments[part], self._grads(group["params"]), 1 - group["betas"][0])
        scaling = self.coeffs["scaling"].tolist()
        torch._foreach_mul_(moments, scaling)
        self._compressed_mean(self.flat["exp_avg"])
        torch._foreach_div_(moments, scaling)
        self.lamb_coeffs = []
        for group, part in self.groups():
            self._adjusted_update(group, part, step, previous[part])

    def _set_scaling(self, moments: list[torch.Tensor]) -> None:
        """Each parameter's momentum to the mean magnitude, so one block scale fits neighbouring parameters."""
        rms = torch.stack([m.norm() / m.numel() ** 0.5 for m in moments])
        scaling = torch.where(rms > 0, rms.mean() / rms, torch.ones_like(rms))
        self.coeffs["scaling"].copy_(scaling)

    def _adjusted_update(self, group: dict[str, Any], part: slice, step: int, previous: list[torch.Tensor]) -> None:
        """LAMB's step with the frozen variance and the frozen trust ratio times the adjusting factor."""
        params, (beta1, beta2), eps = group["params"], group["betas"], group["eps"]
        moments = [self.state[p]["exp_avg"] for p in params]
        fresh = [self.state[p]["exp_avg_sq_fresh"] for p in params]
        gradients = torch._foreach_sub(moments, torch._foreach_mul(previous, beta1))  # what the momentum last took in
        torch._foreach_div_(gradients, 1 - beta1)
        torch._foreach_mul_(fresh, beta2)
        torch._foreach_addcmul_(fresh, gradients, gradients, value=1 - beta2)
        variances = [self.state[p]["exp_avg_sq"] for p in params]
        denoms = frozen_denominators(variances, 1.0, eps)  # LAMB corrects the step size, not the denominator
        prelim = torch._foreach_div(moments, denoms)
        updates = torch._foreach_add(prelim, params, alpha=group["weight_decay"]) if group["weight_decay"] else prelim
        fresh_denoms = torch._foreach_add(torch._foreach_sqrt(fresh), eps)
        ratios = torch._foreach_div(denoms, fresh_denoms)
        factor = torch.stack([r.masked_fill(v == 0, 0.0).max() for r, v in zip(ratios, variances)])
        if group["weight_decay"]:
            norms = torch.stack(torch._foreach_norm(prelim)) / torch.stack(torch._foreach_norm(updates))
            ratio = norms.clamp(max=1.0)
            factor = factor * ratio + (1.0 - ratio)
        last = self.coeffs["last_factor"][part]
        factor = factor.clamp(self.factor_min, self.factor_max)
        factor = torch.minimum(torch.maximum(factor, last * (1 - self.factor_threshold)), last * (1 + self.factor_threshold))
        last.copy_(factor)
        coeffs = self._frozen_ratio()[part] * factor
        self.lamb_coeffs += list(coeffs)
        torch._foreach_mul_(updates, (coeffs * lamb_step_size(group, step, self.freeze_step)).tolist())
        torch._foreach_sub_(params, updates)

    def _frozen_ratio(self) -> torch.Tensor:
        """The trust ratios' running average, bias-corrected like Adam's moments: DeepSpeed uses it raw, which after a
        short warm-up (freeze_step near 1 / (1 - coeff_beta)) shrinks every compressed step by up to a third."""
        averaged = self.coeffs["averaged"]
        correction = 1 - torch.pow(torch.full_like(averaged, self.coeff_beta), averaged)
        return torch.where(averaged > 0, self.coeffs["frozen"] / correction.clamp(min=1e-12), torch.ones_like(averaged))

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratio each parameter got in the last step, in param-group order."""
        return [float(c) for c in self.lamb_coeffs]

    def rank_local_state(self) -> dict[str, torch.Tensor]:
        return {**super().rank_local_state(), **{f"coeffs.{k}": v for k, v in self.coeffs.items()}}

    def load_rank_local_state(self, own: dict[str, torch.Tensor] | None, first: dict[str, torch.Tensor]) -> list[str]:
        lost = super().load_rank_local_state(own, first)
        source = own if own is not None else first  # the coefficients are the same on every rank
        for key, value in self.coeffs.items():
            saved = source.get(f"coeffs.{key}")
            if saved is not None and saved.shape == value.shape:
                value.copy_(saved)
            elif self.steps > 0:
                lost.append(f"1-bit LAMB's {key} coefficients (not in the checkpoint)")
        return lost
