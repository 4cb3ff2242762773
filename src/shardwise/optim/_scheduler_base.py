"""What every learning-rate scheduler in :mod:`shardwise.optim.schedulers` shares.

The base class owns the DeepSpeed stepping contract: ``last_batch_iteration`` counts the batches
already trained (-1 before the first), ``step()`` advances it and writes the new lr into every
param group, and the checkpointed state is that counter alone. Subclasses only say what the lr
is at ``last_batch_iteration``. The warmup curve is here too because three schedulers use it.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch.optim import Optimizer

WARMUP_TYPES = ("log", "linear")


def invalid_param(name: str, requirement: str, value: Any, fix: str) -> ValueError:
    """A ValueError shaped "<param>: <what is required>; got <value>. <how to fix>."."""
    return ValueError(f"{name}: {requirement}; got {value!r}. {fix}")


def is_int(value: Any) -> bool:
    # bool is an int subclass, but `warmup_num_steps: true` is a config mistake, not a count.
    return isinstance(value, int) and not isinstance(value, bool)


def check_non_negative(name: str, value: Any, fix: str) -> None:
    if value < 0:
        raise invalid_param(name, "must be >= 0", value, fix)


def unwrap_optimizer(optimizer: Any) -> Optimizer:
    """The torch optimizer whose param groups hold the lr.

    Mixed-precision and ZeRO wrappers keep it in ``.optimizer``; DeepSpeed's schedulers look
    one level down the same way, so a scheduler can be handed either.
    """
    if isinstance(optimizer, Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, Optimizer):
        return inner
    raise TypeError(
        f"optimizer: must be a torch.optim.Optimizer or an object holding one in `.optimizer`; "
        f"got {type(optimizer).__name__}. Pass the optimizer whose learning rate should be scheduled."
    )


def per_group(optimizer: Optimizer, value: Any, name: str) -> list[Any]:
    """One value per param group: a scalar is shared by all groups, a list must have one per group."""
    n_groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n_groups:
            raise invalid_param(
                name,
                f"must be a single number or a list with one entry per param group ({n_groups})",
                value,
                f"Give one value, or {n_groups} values in param-group order.",
            )
        return list(value)
    return [value] * n_groups


class Warmup:
    """The warmup curve: how far from the start value to the peak after ``iteration`` batches.

    'linear' is ``iteration / num_steps``; 'log' is ``log(iteration + 1) / log(num_steps)``, which
    rises fast early and reaches 1 one step before linear does.
    """

    def __init__(self, num_steps: Any, warmup_type: Any) -> None:
        if not is_int(num_steps) or num_steps <= 0:
            raise invalid_param(
                "warmup_num_steps",
                "must be a positive integer",
                num_steps,
                "Set it to the number of batches over which the lr rises (e.g. 1000).",
            )
        if warmup_type not in WARMUP_TYPES:
            # DeepSpeed logs a warning and silently uses 'log'; a typo should not change the curve.
            raise invalid_param(
                "warmup_type", "must be 'log' or 'linear'", warmup_type, "Use one of 'log', 'linear'."
            )
        # log(1) = 0 would make the log curve divide by zero; DeepSpeed clamps to 2 for both types,
        # so a 1-step warmup lasts 2 steps there and must here too.
        self.num_steps: int = max(2, num_steps)
        self.warmup_type: str = warmup_type
        # Multiplying by a precomputed inverse (rather than dividing) keeps the lr bit-identical to
        # DeepSpeed's.
        self._inverse_log = 1.0 / math.log(self.num_steps)

    def active(self, iteration: int) -> bool:
        return iteration < self.num_steps

    def fraction(self, iteration: int) -> float:
        if self.warmup_type == "log":
            return self._inverse_log * math.log(iteration + 1)
        return iteration / self.num_steps


class LRSchedulerBase:
    """DeepSpeed's scheduler protocol. Subclasses implement :meth:`get_lr`."""

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        self.optimizer: Optimizer = unwrap_optimizer(optimizer)
        self.last_batch_iteration: int = last_batch_iteration
        self._last_lr: list[Any] | None = None

    def _start(self) -> None:
        """Called last by each constructor: a fresh schedule (-1) writes its starting lr at once,
        so the first optimizer step (which runs before the first scheduler step) already uses it.
        A resumed schedule leaves the optimizer alone until its next step()."""
        if self.last_batch_iteration == -1:
            self._apply(self.get_lr())

    def get_lr(self) -> list[Any]:
        """The lr of each param group at ``last_batch_iteration``; does not touch the optimizer."""
        raise NotImplementedError

    def get_last_lr(self) -> list[Any]:
        """The lrs last written into the optimizer."""
        if self._last_lr is None:
            raise RuntimeError(
                "get_last_lr: needs an lr written by this scheduler; got none yet (it was built with "
                "last_batch_iteration != -1). Call step() first."
            )
        return self._last_lr

    def step(self, last_batch_iteration: int | None = None, batch_iteration: int | None = None) -> None:
        """Move to the next batch (or to the one given) and write its lr into the optimizer.

        ``batch_iteration`` is the name DeepSpeed's OneCycle and LRRangeTest give this argument;
        either name is accepted so ``engine.step(lr_kwargs=...)`` calls written for DeepSpeed work.
        """
        if last_batch_iteration is not None and batch_iteration is not None:
            raise invalid_param(
                "batch_iteration",
                "must not be given together with last_batch_iteration (they are the same argument)",
                batch_iteration,
                "Pass only one of them.",
            )
        if last_batch_iteration is None:
            last_batch_iteration = batch_iteration
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply(self.get_lr())

    def _apply(self, lrs: Sequence[Any]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs):
            if torch.is_tensor(group["lr"]):
                # A tensor lr (capturable / compiled optimizers) is read by identity: fill it in place.
                group["lr"].fill_(lr.squeeze() if torch.is_tensor(lr) else lr)
            else:
                group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        # The counter alone, as DeepSpeed saves it: the lr itself is restored with the optimizer's
        # param groups, and everything else comes from the config.
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_batch_iteration = state_dict["last_batch_iteration"]
