"""Loss scalers: none (fp32/bf16), static, and dynamic (fp16). They know nothing of sharding.

The strategy tells the scaler whether the step overflowed (already agreed across ranks); the scaler
only decides the next scale.

[Note: dynamic loss scaling] The scale starts at 2**initial_scale_power. An overflowing step is
skipped; `hysteresis` overflows are tolerated before the scale is halved (never below
`min_loss_scale`). After `loss_scale_window` steps without overflow the scale doubles and the
hysteresis budget is refilled (with `consecutive_hysteresis` it is refilled after every clean step).
These are DeepSpeed's semantics, so fp16 runs skip the same steps as they did there.
"""

from __future__ import annotations

from typing import Any

from ..config import FP16Config


class NoLossScaler:
    """fp32 and bf16: scale 1, nothing to adapt (a nan/inf there is a divergence, not an fp16 overflow;
    the step is still skipped and reported, see runtime/step.py)."""

    scale: float = 1.0
    checks_overflow = False

    def update(self, overflow: bool) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class StaticLossScaler(NoLossScaler):
    checks_overflow = True

    def __init__(self, scale: float):
        self.scale = scale


class DynamicLossScaler:
    checks_overflow = True

    def __init__(self, cfg: FP16Config, factor: float = 2.0):
        self.scale = float(2**cfg.initial_scale_power)
        self.window = cfg.loss_scale_window
        self.hysteresis = cfg.hysteresis
        self.consecutive_hysteresis = cfg.consecutive_hysteresis
        self.min_scale = cfg.min_loss_scale
        self.factor = factor
        self.hysteresis_left = cfg.hysteresis
        self.iteration = 0
        self.last_overflow_iteration = -1

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.hysteresis_left <= 1:
                self.scale = max(self.scale / self.factor, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow_iteration = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            if (self.iteration - self.last_overflow_iteration) % self.window == 0:
                self.hysteresis_left = self.hysteresis
                self.scale *= self.factor
        self.iteration += 1

    def state_dict(self) -> dict[str, Any]:
        keys = ("scale", "hysteresis_left", "iteration", "last_overflow_iteration")
        return {k: getattr(self, k) for k in keys}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)


LossScaler = NoLossScaler | StaticLossScaler | DynamicLossScaler


def make_loss_scaler(fp16: FP16Config) -> LossScaler:
    if not fp16.enabled:
        return NoLossScaler()
    if fp16.loss_scale > 0:
        return StaticLossScaler(fp16.loss_scale)
    return DynamicLossScaler(fp16)
