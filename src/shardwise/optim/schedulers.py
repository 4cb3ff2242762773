"""Learning-rate schedulers with DeepSpeed's names, parameters and numbers.

Each class takes the keyword arguments a DeepSpeed config puts in ``scheduler.params`` and gives
the same lr, bit for bit, at every batch, so a DeepSpeed config trains the same here. The stepping
contract (``last_batch_iteration``, what construction writes, the checkpointed state) lives in
:mod:`shardwise.optim._scheduler_base`.

Where these differ from DeepSpeed 0.19, on purpose:

* an unknown ``warmup_type`` is a ValueError (DeepSpeed warns and uses 'log');
* negative stair counts, decay step sizes or total step counts are ValueErrors (DeepSpeed accepts
  them and produces meaningless schedules);
* OneCycle's ``get_last_lr()`` works right after construction (DeepSpeed raises until a step).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch.optim import Optimizer

from ._scheduler_base import LRSchedulerBase, Warmup, check_non_negative, invalid_param, is_int, per_group

logger = logging.getLogger(__name__)

__all__ = ["LRRangeTest", "OneCycle", "SCHEDULERS", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]


def _check_total_num_steps(total_num_steps: Any) -> None:
    check_non_negative("total_num_steps", total_num_steps, "Set it to the number of batches the run trains for.")


def _warn_if_no_decay(total_num_steps: Any, warmup: Warmup) -> None:
    if total_num_steps < warmup.num_steps:
        logger.warning(
            "total_num_steps %s is less than warmup_num_steps %s: the lr never decays from its peak",
            total_num_steps,
            warmup.num_steps,
        )


class WarmupLR(LRSchedulerBase):
    """Rise from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps`` batches, then hold.

    ``warmup_max_lr=None`` takes each param group's lr at construction as its peak.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.warmup = Warmup(warmup_num_steps, warmup_type)
        if warmup_max_lr is None:
            warmup_max_lr = [_snapshot(group["lr"]) for group in self.optimizer.param_groups]
        self.min_lrs = per_group(self.optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = per_group(self.optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        self._start()

    def _gamma(self) -> float:
        """Fraction of the way from min to max lr at the current batch."""
        if self.warmup.active(self.last_batch_iteration):
            return self.warmup.fraction(self.last_batch_iteration)
        return 1.0

    def get_lr(self) -> list[Any]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay that reaches 0 at ``total_num_steps`` and stays there."""

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        _check_total_num_steps(total_num_steps)
        self.total_num_steps = total_num_steps  # set first: the parent constructor computes an lr
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        _warn_if_no_decay(total_num_steps, self.warmup)

    def _gamma(self) -> float:
        if self.warmup.active(self.last_batch_iteration):
            return self.warmup.fraction(self.last_batch_iteration)
        remaining = float(self.total_num_steps - self.last_batch_iteration)
        decay_steps = float(max(1.0, self.total_num_steps - self.warmup.num_steps))
        return max(0.0, remaining / decay_steps)


class WarmupCosineLR(LRSchedulerBase):
    """Scale each group's own lr: rise from ``warmup_min_ratio`` to 1 over the warmup, then follow
    half a cosine down to ``cos_min_ratio`` at ``total_num_steps`` and stay there.

    The lr each group has at construction is the peak; the config gives ratios, not lrs.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.warmup = Warmup(warmup_num_steps, warmup_type)
        _check_total_num_steps(total_num_steps)
        _warn_if_no_decay(total_num_steps, self.warmup)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        self.org_lrs = [_snapshot(group["lr"]) for group in self.optimizer.param_groups]
        self._start()

    def get_lr_ratio(self) -> float:
        k = self.last_batch_iteration
        if k < 0:
            return 0.0
        if self.warmup.active(k):
            return self.warmup_min_ratio + self.warmup.fraction(k) * (1.0 - self.warmup_min_ratio)
        decay_step = k - self.warmup.num_steps + 1
        decay_steps = max(1, self.total_num_steps - self.warmup.num_steps)
        # Clamped to 1 so that past the end the ratio stays at cos_min_ratio instead of rising
        # again along the cosine.
        progress = min(1.0, decay_step / decay_steps)
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[Any]:
        if self.last_batch_iteration < 0:
            # DeepSpeed starts at 0, not at warmup_min_ratio: the first batch trains with lr 0.
            return [0.0 for _ in self.org_lrs]
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


class OneCycle(LRSchedulerBase):
    """The 1Cycle policy: the lr climbs from ``cycle_min_lr`` to ``cycle_max_lr`` over
    ``cycle_first_step_size`` batches and back over ``cycle_second_step_size``, while momentum
    (Adam-style ``betas[0]``) moves the opposite way; after the cycle the lr (and momentum) decay
    every ``decay_step_size`` batches if a decay rate is set. Stair counts hold each value flat for
    a stretch of the half cycle instead of moving it every batch.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        cycle_min_lr: float | list[float],
        cycle_max_lr: float | list[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | list[float] = 0.8,
        cycle_max_mom: float | list[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        first = float(cycle_first_step_size)
        second = first if cycle_second_step_size is None else float(cycle_second_step_size)
        # A zero first half would divide by zero in the ramp; a zero second half is a sawtooth.
        if first <= 0:
            raise invalid_param(
                "cycle_first_step_size",
                "must be > 0",
                cycle_first_step_size,
                "Set it to the number of batches the lr takes to climb (e.g. 1000).",
            )
        if cycle_second_step_size is not None:
            fix = "Set it to the number of batches the lr takes to come back down."
            check_non_negative("cycle_second_step_size", cycle_second_step_size, fix)
        if cycle_second_stair_count is None:
            cycle_second_stair_count = cycle_first_stair_count
        stair_fix = "Use 0 for a smooth ramp, or the number of stairs in that half cycle."
        check_non_negative("cycle_first_stair_count", cycle_first_stair_count, stair_fix)
        check_non_negative("cycle_second_stair_count", cycle_second_stair_count, stair_fix)
        check_non_negative("decay_step_size", decay_step_size, "Use 0 for no decay after the cycle.")

        self.first_step_size = first
        self.second_step_size = second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = cycle_second_stair_count
        self.decay_step_size = decay_step_size
        self.min_lrs = per_group(self.optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = per_group(self.optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = decay_step_size == 0 or decay_lr_rate == 0

        self.cycle_momentum = cycle_momentum and "betas" in self.optimizer.defaults
        if cycle_momentum and not self.cycle_momentum:
            logger.warning(
                "OneCycle: cycle_momentum is off because %s has no `betas` to cycle",
                type(self.optimizer).__name__,
            )
        if self.cycle_momentum:
            # DeepSpeed pins betas[1] to 0.99 whatever the optimizer was built with; kept for parity.
            self.min_moms = [(m, 0.99) for m in per_group(self.optimizer, cycle_min_mom, "cycle_min_mom")]
            self.max_moms = [(m, 0.99) for m in per_group(self.optimizer, cycle_max_mom, "cycle_max_mom")]
            self.decay_mom_rate = decay_mom_rate
            self.skip_mom_decay = decay_step_size == 0 or decay_mom_rate == 0
            if last_batch_iteration == -1:
                # DeepSpeed starts momentum at its *minimum* although the first step jumps to near
                # the maximum; the first optimizer step runs with these betas, so parity keeps it.
                self._apply_momentum(self.min_moms)
        self._start()

    def _scale_factor(self) -> float:
        """Where the lr sits between min (0) and max (1) inside the current cycle."""
        batch = self.last_batch_iteration + 1
        cycle = math.floor(1 + batch / self.total_size)
        x = 1.0 + batch / self.total_size - cycle  # position in the cycle, in [0, 1)
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            # Quantise from the integer batch offset, not from `scale`: at a half-cycle boundary the
            # float scale can land 1e-16 under a stair and floor() would drop a whole stair.
            offset = batch % self.total_size
            if offset <= self.first_step_size:
                position = offset * stairs / self.first_step_size
            else:
                position = (self.total_size - offset) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def _in_cycle(self) -> bool:
        return self.last_batch_iteration < self.total_size

    def _decay_interval(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list[float]:
        if self._in_cycle():
            scale = self._scale_factor()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * self._decay_interval()
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """The betas each group gets at the current batch, or None when momentum is not cycled."""
        if not self.cycle_momentum:
            return None
        if self._in_cycle():
            scale = self._scale_factor()
            return [(hi[0] - (hi[0] - lo[0]) * scale, lo[1]) for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * self._decay_interval()
        return [(beta1 * factor, beta2) for beta1, beta2 in self.max_moms]

    def _apply_momentum(self, moms: list[tuple[float, float]]) -> None:
        for group, betas in zip(self.optimizer.param_groups, moms):
            group["betas"] = betas

    def step(self, last_batch_iteration: int | None = None, batch_iteration: int | None = None) -> None:
        super().step(last_batch_iteration, batch_iteration)
        moms = self.get_mom()
        if moms is not None:
            self._apply_momentum(moms)


class LRRangeTest(LRSchedulerBase):
    """Grow the lr from ``lr_range_test_min_lr`` by ``lr_range_test_step_rate`` times the min lr
    every ``lr_range_test_step_size`` batches (continuously, or in stairs), to find the largest lr
    that still trains.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        lr_range_test_min_lr: float | list[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        if not is_int(lr_range_test_step_size) or lr_range_test_step_size <= 0:
            raise invalid_param(
                "lr_range_test_step_size",
                "must be a positive integer",
                lr_range_test_step_size,
                "Set it to the number of batches per lr increase (e.g. 2000).",
            )
        self.min_lr = per_group(self.optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        self._start()

    def _interval(self) -> float:
        """How many step sizes have passed, whole ones only for a staircase."""
        intervals = float(self.last_batch_iteration + 1) / self.step_size
        return math.floor(intervals) if self.staircase else intervals

    def get_lr(self) -> list[float]:
        increase = 1 + self.step_rate * self._interval()
        return [lr * increase for lr in self.min_lr]


def _snapshot(lr: Any) -> Any:
    # A tensor lr is filled in place by the scheduler itself; keep its starting value, not the alias.
    return lr.clone() if torch.is_tensor(lr) else lr


SCHEDULERS: dict[str, type[LRSchedulerBase]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle,
    "LRRangeTest": LRRangeTest,
}
