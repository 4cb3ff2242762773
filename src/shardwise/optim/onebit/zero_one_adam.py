"""0/1 Adam (Lu et al., 2022, arXiv:2202.06009) with DeepSpeed's `ZeroOneAdam` parameters.

Two phases, each a function of the step count (`_Schedule`), so a resumed run is where it was:

- Steps 1..var_freeze_step: Adam whose variance is updated only on steps of an exponentially thinning set
  (every step at first; the interval doubles after every `var_update_scaler` updates). Those steps average
  the gradients exactly (the strategy does); the others average them in 1 bit (`CompressedAllReduce`) and
  update only the momentum. The variance's bias correction counts its updates, not the steps.
- Later steps are local: each rank updates its momentum and weights from its own gradient, and only every
  `local_step_interval` steps (doubling every `local_step_scaler` steps, at most `local_step_clipper`) the
  ranks average, in 1 bit, the update they accumulated since the last sync (scaled into momentum units by
  the frozen denominator), restart from the synced weights plus that mean, and take the momentum it implies.
  Between syncs the ranks' weights differ; a checkpoint keeps each rank's ([Note: who reduces what]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch

from ._checks import check_adam_arguments
from .base import CompressedOptimizer

__all__ = ["ZeroOneAdam"]


@dataclass
class _Schedule:
    """DeepSpeed's counters, replayed from step 0: which steps update the variance and which local steps sync."""

    var_freeze_step: int
    var_update_scaler: int
    local_step_scaler: int
    local_step_clipper: int
    step: int = 0
    var_interval: int = 1
    var_counter: int = 0
    var_updates: int = 0
    local_interval: int = 1
    local_counter: int = 0

    def at(self, step: int) -> _Schedule:
        """The counters as they are for `step` (before its own update); replays from 0 when going back."""
        if step <= self.step:
            fresh = _Schedule(self.var_freeze_step, self.var_update_scaler, self.local_step_scaler, self.local_step_clipper)
            self.__dict__.update(fresh.__dict__)
        while self.step + 1 < step:
            self._after(self.step + 1)
        self.step = step - 1 if step > 0 else 0
        return self

    def updates_variance(self, step: int) -> bool:
        return step <= self.var_freeze_step and step % self.var_interval == 0

    def syncs(self, step: int) -> bool:
        return step > self.var_freeze_step and step % self.local_interval == 0

    def _after(self, step: int) -> None:
        if self.updates_variance(step):
            self.var_updates += 1
            self.var_counter += 1
            if self.var_counter == self.var_update_scaler:
                self.var_counter, self.var_interval = 0, self.var_interval * 2
        elif step > self.var_freeze_step:
            self.local_counter += 1
            if self.local_counter == self.local_step_scaler:
                self.local_counter = 0
                self.local_interval = min(self.local_step_clipper, self.local_interval * 2)
        self.step = step


class ZeroOneAdam(CompressedOptimizer):
    """Args as DeepSpeed's: lr, betas, eps, weight_decay (decoupled), bias_correction, var_freeze_step,
    var_update_scaler, local_step_scaler, local_step_clipper; amsgrad refused; cuda_aware and
    comm_backend_name accepted (shardwise sends through the engine's process group)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, var_freeze_step: int = 100000,
                 var_update_scaler: int = 16, local_step_scaler: int = 32678, local_step_clipper: int = 16,
                 amsgrad: bool = False, cuda_aware: bool = False, comm_backend_name: str = "nccl"):
        check_adam_arguments(type(self).__name__, lr, betas, eps, weight_decay, max_grad_norm, amsgrad, eps_inside_sqrt,
                             {"var_freeze_step": var_freeze_step, "var_update_scaler": var_update_scaler,
                              "local_step_scaler": local_step_scaler, "local_step_clipper": local_step_clipper})
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        super().__init__(params, defaults, cuda_aware, comm_backend_name)
        self.schedule = _Schedule(var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper)
        self.accumulated = torch.zeros_like(self.flat["exp_avg"])
        """This rank's update since the last sync (local phase)."""
        self.accumulated_lr = torch.zeros(())
        """The sum of the step sizes (lr / bias correction) since the last sync."""
        self.synced = torch.zeros_like(self.flat["exp_avg"])
        """The weights at the last sync, the same on every rank: a sync starts from them, not from weights minus
        the accumulated update, which rounding would leave a little different on each rank."""

    def reduces_gradients(self) -> bool:
        step = self.steps + 1
        return self.schedule.at(step).updates_variance(step)

    def _take_step(self, step: int) -> None:
        schedule = self.schedule.at(step)
        if step > schedule.var_freeze_step:
            self._local_step(step, schedule)
        else:
            self._variance_phase_step(step, schedule)

    def _variance_phase_step(self, step: int, schedule: _Schedule) -> None:
        exact = schedule.updates_variance(step)
        grads = self._grads(self._params)
        if not exact:  # average this rank's gradient in 1 bit
            mean = torch.cat([g.reshape(-1) for g in grads])
            self._compressed_mean(mean)
            grads = self.views(mean)
        variance_steps = schedule.var_updates + (1 if exact else 0)
        for group, part in self.groups():
            self._adam_moments(group, grads[part], variance=exact)
            torch._foreach_sub_(group["params"], self._updates(group, step, variance_steps))

    def _updates(self, group: dict[str, Any], step: int, variance_steps: int) -> list[torch.Tensor]:
        """Adam's step for `group` (decoupled weight decay) as new tensors."""
        params = group["params"]
        updates = torch._foreach_div([self.state[p]["exp_avg"] for p in params],
                                     self._adam_denominators(group, variance_steps))
        torch._foreach_mul_(updates, self._adam_step_size(group, step))
        if group["weight_decay"] != 0:
            torch._foreach_add_(updates, params, alpha=group["lr"] * group["weight_decay"])
        return updates

    def _local_step(self, step: int, schedule: _Schedule) -> None:
        if step == schedule.var_freeze_step + 1:
            self._start_local_phase()
        grads = self._grads(self._params)
        accumulated = self.views(self.accumulated)
        for group, part in self.groups():
            self._adam_moments(group, grads[part], variance=False)
            updates = self._updates(group, step, schedule.var_updates)
            torch._foreach_sub_(group["params"], updates)
            torch._foreach_add_(accumulated[part], updates)
        # One sum of step sizes for the whole model, as DeepSpeed keeps: groups differ in weight decay, not in lr.
        self.accumulated_lr += self._adam_step_size(self.param_groups[-1], step)
        if schedule.syncs(step):
            self._sync(schedule.var_updates)

    def _start_local_phase(self) -> None:
        if self.allreduce is not None:
            self.allreduce.reset_errors()  # from here on they measure accumulated updates, not gradients
        torch._foreach_copy_(self.views(self.synced), self._params)

    def _sync(self, variance_steps: int) -> None:
        """The last synced weights minus the ranks' mean accumulated update; the momentum that update implies."""
        accumulated = self.views(self.accumulated)
        denoms = [d for group in self.param_groups for d in self._adam_denominators(group, variance_steps, hold_unseen=False)]
        torch._foreach_mul_(accumulated, denoms)  # into momentum units: sum of step size x momentum
        self._compressed_mean(self.accumulated)
        torch.div(self.accumulated, self.accumulated_lr, out=self.flat["exp_avg"])
        torch._foreach_div_(accumulated, denoms)
        self.synced.sub_(self.accumulated)
        torch._foreach_copy_(self._params, self.views(self.synced))
        self.accumulated.zero_()
        self.accumulated_lr.zero_()

    def rank_local_state(self) -> dict[str, torch.Tensor]:
        state = super().rank_local_state()
        if self.steps > self.schedule.var_freeze_step:  # the ranks' weights and momenta differ until the next sync
            state.update(accumulated=self.accumulated, accumulated_lr=self.accumulated_lr, synced=self.synced,
                         exp_avg=self.flat["exp_avg"], params=torch.cat([p.detach().reshape(-1) for p in self._params]))
        return state

    def load_rank_local_state(self, own: dict[str, torch.Tensor] | None, first: dict[str, torch.Tensor]) -> list[str]:
        lost = super().load_rank_local_state(own, first)
        if own is not None and "accumulated" in own and own["accumulated"].numel() == self.numel:
            self.accumulated.copy_(own["accumulated"])
            self.accumulated_lr.copy_(own["accumulated_lr"])
            self.synced.copy_(own["synced"])
            self.flat["exp_avg"].copy_(own["exp_avg"])
            torch._foreach_copy_(self._params, self.views(own["params"]))
            return lost
        had_local = "accumulated" in first and bool(first["accumulated_lr"] != 0)
        self.accumulated.zero_()
        self.accumulated_lr.zero_()
        torch._foreach_copy_(self.views(self.synced), self._params)  # rank 0's weights are the synced ones now
        if had_local:
            lost.append("each rank's local 0/1 Adam steps since the last sync (rank 0's weights and momentum are "
                        "taken as the synced state)")
        return lost
