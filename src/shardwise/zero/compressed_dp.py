"""ZeRO stage 0 for the communication-compressed optimizers (1-bit Adam, 0/1 Adam, 1-bit LAMB).

Plain data parallelism, except that the optimizer decides, step by step, whether the backward averages the
gradients ([Note: who reduces what] in `optim/onebit/base.py`). On a step that does not, every rank keeps its
own gradient and the optimizer exchanges compressed momentum instead; clipping and the overflow check still
need one number that is the same on every rank, so the gradient norm is then the root mean square of the
ranks' own norms (one 4-byte all-reduce): a rank whose gradient overflowed makes every rank skip.

Only stage 0: the compressed exchange averages a whole replicated momentum, which ZeRO's partitions of it
would have to gather first, costing more than the compression saves (DeepSpeed refuses ZeRO with them too).
"""

from __future__ import annotations

import torch

from ..optim.onebit.base import CompressedOptimizer
from ..protocols import StrategyInputs
from .stage0 import DataParallel


class CompressedDataParallel(DataParallel):
    def __init__(self, inputs: StrategyInputs):
        super().__init__(inputs)
        if not isinstance(self.optimizer, CompressedOptimizer):
            raise TypeError(f"optimizer: a communication-compressed optimizer (OneBitAdam, ZeroOneAdam, OneBitLamb) "
                            f"is required here; got {type(self.optimizer).__name__}.")
        self.optimizer.connect(inputs.comm, inputs.dp_group)
        self.local_grads = False
        """This step's gradients stay on their rank (the optimizer exchanges compressed state instead)."""

    def begin_backward(self, reduce: bool) -> None:
        self.local_grads = not self.optimizer.reduces_gradients()
        self.buckets.begin(reduce and not self.local_grads)

    def grad_norm(self) -> torch.Tensor:
        norm = self.buckets.grad_norm()
        if not self.local_grads or self.group.size == 1:
            return norm
        mean_square = norm.pow(2).reshape(1) / self.group.size
        self.comm.all_reduce(mean_square, self.group).wait()
        return mean_square.sqrt()[0]

    def rank_local_state(self) -> dict[str, torch.Tensor]:
        return self.optimizer.rank_local_state()

    def load_rank_local_state(self, own: dict[str, torch.Tensor] | None, first: dict[str, torch.Tensor]) -> list[str]:
        return self.optimizer.load_rank_local_state(own, first)
