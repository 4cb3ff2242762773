"""CPU Adam/AdamW with DeepSpeedCPUAdam's constructor.

The math runs in torch's fused CPU Adam kernel (vectorised, multi-threaded over torch's intra-op
threads), which `benchmarks/cpu_adam.py` measures against DeepSpeedCPUAdam and the memory-bandwidth
limit; a hand-written kernel would have to beat it to earn its place.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch


class CPUAdam(torch.optim.AdamW):
    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True):
        if not bias_correction:
            raise ValueError("CPUAdam: bias_correction=False is not supported; remove the argument.")
        if not fp32_optimizer_states:
            raise ValueError("CPUAdam: optimizer states are always fp32; remove fp32_optimizer_states=False.")
        self.adamw_mode = adamw_mode
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         fused=True)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if not self.adamw_mode:
            # Classic Adam: L2 weight decay enters the gradient instead of decaying the weights.
            for group in self.param_groups:
                if group["weight_decay"]:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.grad.add_(p, alpha=group["weight_decay"])
            saved = [g["weight_decay"] for g in self.param_groups]
            for g in self.param_groups:
                g["weight_decay"] = 0.0
            try:
                return super().step(closure)
            finally:
                for g, wd in zip(self.param_groups, saved):
                    g["weight_decay"] = wd
        return super().step(closure)
