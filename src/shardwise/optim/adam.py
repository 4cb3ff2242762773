"""Adam/AdamW with DeepSpeed's two constructors: `CPUAdam` (DeepSpeedCPUAdam) and `FusedAdam`.

The math runs in torch's fused Adam kernel (CPU and CUDA; vectorised, multi-threaded over torch's
intra-op threads), which `benchmarks/cpu_adam.py` measures against DeepSpeedCPUAdam and the
memory-bandwidth limit; a hand-written kernel would have to beat it to earn its place. Both classes
differ only in their argument names: DeepSpeed spells the decoupled-decay switch `adamw_mode` in one
and `adam_w_mode` in the other.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch


class _AdamWithMode(torch.optim.AdamW):
    """AdamW, or classic Adam with L2 weight decay when `adamw_mode` is false, in torch's fused kernel."""

    def __init__(self, params: Iterable[Any], lr: float, bias_correction: bool, betas: tuple[float, float],
                 eps: float, weight_decay: float, amsgrad: bool, adamw_mode: bool):
        if not bias_correction:
            raise ValueError(f"{type(self).__name__}: bias_correction=False is not supported; remove the argument.")
        self.adamw_mode = adamw_mode
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         fused=True)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if self.adamw_mode:
            return super().step(closure)
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


class CPUAdam(_AdamWithMode):
    """DeepSpeedCPUAdam's constructor (`deepspeed.ops.adam.DeepSpeedCPUAdam`)."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True):
        if not fp32_optimizer_states:
            raise ValueError("CPUAdam: optimizer states are always fp32; remove fp32_optimizer_states=False.")
        super().__init__(model_params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adamw_mode)


class FusedAdam(_AdamWithMode):
    """DeepSpeed's `FusedAdam` constructor (`deepspeed.ops.adam.FusedAdam`), for parameters on any device.

    `set_grad_none` is accepted for DeepSpeed scripts: `zero_grad()` sets gradients to None by default in
    torch already, and the engine owns gradients anyway."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True):
        if amsgrad:
            raise ValueError("FusedAdam: amsgrad=True is not supported (nor by DeepSpeed's FusedAdam); "
                             "use torch.optim.AdamW(amsgrad=True).")
        super().__init__(params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adam_w_mode)


class CPUAdagrad(torch.optim.Adagrad):
    """DeepSpeedCPUAdagrad's constructor (`deepspeed.ops.adagrad.DeepSpeedCPUAdagrad`): Adagrad with the
    weight decay added to the gradient, which is torch's Adagrad arithmetic."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0.0,
                 amsgrad: bool = False, fp32_optimizer_states: bool = True):
        if amsgrad:
            raise ValueError("CPUAdagrad: amsgrad=True is not supported (nor by DeepSpeedCPUAdagrad); remove it.")
        if not fp32_optimizer_states:
            raise ValueError("CPUAdagrad: optimizer states are always fp32; remove fp32_optimizer_states=False.")
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)
