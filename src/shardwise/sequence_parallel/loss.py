"""The loss over a sequence split across ranks: each rank's mean over its unmasked tokens, weighted by how many
it has (a rank may have none: a prompt masked with -100 can fill whole slices).

The gather is differentiable with a summing backward (transformers' `deepspeed_sp_compute_loss` uses the same
convention), so each rank's gradients are `size` times its share; the engine's average over the data group,
which holds the sequence ranks, divides that back.
"""

from __future__ import annotations

import torch

from .link import SequenceLink

IGNORE_INDEX = -100


class _GatherSum(torch.autograd.Function):
    """Forward: every rank's scalar, stacked. Backward: this rank's entry of the summed gradients."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, link: SequenceLink) -> torch.Tensor:
        ctx.link = link
        return torch.stack(link.all_gather(value.reshape(1))).reshape(link.size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        link = ctx.link
        total = grad.detach().contiguous().clone()
        link.comm.all_reduce(total, link.group).wait()
        return total[link.rank].reshape(()), None


def combine_loss(loss: torch.Tensor, shift_labels: torch.Tensor, link: SequenceLink) -> torch.Tensor:
    """The mean loss over the whole sequence from this rank's `loss` (its mean over the tokens of
    `shift_labels` that are not -100)."""
    if link.size == 1:
        return loss
    tokens = (shift_labels != IGNORE_INDEX).sum().to(loss.dtype)
    losses = _GatherSum.apply(loss.reshape(()), link)
    counts = torch.stack(link.all_gather(tokens.reshape(1))).reshape(link.size)
    weighted = torch.where(counts > 0, losses, torch.zeros_like(losses)) * counts
    return weighted.sum() / counts.sum().clamp(min=1)
