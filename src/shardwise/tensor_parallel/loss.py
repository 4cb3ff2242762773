"""Cross entropy over vocabulary-parallel logits: no rank ever holds a full-vocabulary row.

Each rank holds logits for its slice of the vocabulary. The softmax needs the row's maximum and the sum of
its exponentials over the whole vocabulary, and the loss needs the target's logit, which lives on one rank:
one all-reduce of the maxima, one of (sum of exponentials, target logit) stacked. The gradient is
softmax - one_hot on each rank's slice, with no communication.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import TensorLink
from .shard import local_index


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, link: TensorLink) -> torch.Tensor:
        width = logits.shape[-1]
        start = link.rank * width
        row_max = link.all_reduce(logits.max(dim=-1).values.float(), op=dist.ReduceOp.MAX)
        shifted = logits.float() - row_max.unsqueeze(-1)
        local_target, outside = local_index(target, start, width)
        picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp_()
        sums = link.all_reduce(torch.stack([exp.sum(dim=-1), picked]))
        loss = sums[0].log() - sums[1]
        exp.div_(sums[0].unsqueeze(-1))  # now the softmax
        ctx.save_for_backward(exp, local_target, outside)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.dtype), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, link: TensorLink,
                                 ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """`F.cross_entropy(full_logits.flatten(0, -2), target.flatten(), ignore_index=..., reduction=...)` computed
    from this rank's vocabulary slice of the logits (`[..., vocab / tp]`, rank-ordered slices)."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction: 'mean', 'sum' or 'none'; got {reduction!r}.")
    logits, target = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    keep = target != ignore_index
    losses = _VocabParallelCrossEntropy.apply(logits, target.masked_fill(~keep, 0), link) * keep
    if reduction == "none":
        return losses
    total = losses.sum()
    return total / keep.sum().clamp(min=1) if reduction == "mean" else total
