"""Ulysses' all-to-all as an autograd function over the choke point.

`exchange(x, link, split_dim, cat_dim)` cuts `x` into `link.size` chunks along `split_dim`, sends chunk r to rank
r, and joins what arrives along `cat_dim` in rank order. With the sequence on `cat_dim` and heads on
`split_dim`, each rank goes from all heads of its tokens to its heads of all tokens; the reverse exchange goes
back, and each is the other's backward.
"""

from __future__ import annotations

import torch

from .link import SequenceLink


def _exchange(x: torch.Tensor, link: SequenceLink, split_dim: int, cat_dim: int) -> torch.Tensor:
    if x.shape[split_dim] % link.size:
        raise ValueError(f"sequence parallelism: a dim of {x.shape[split_dim]} cannot be split over {link.size} "
                         "sequence-parallel ranks.")
    chunks = x.detach().chunk(link.size, dim=split_dim)
    sent = torch.stack(chunks).contiguous()  # rank r's chunk is the r-th block
    received = torch.empty_like(sent)  # fresh: the choke point may fill it from another thread
    link.comm.all_to_all(received.view(-1), sent.view(-1), link.group).wait()
    return torch.cat(received.unbind(0), dim=cat_dim)


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, link: SequenceLink, split_dim: int, cat_dim: int) -> torch.Tensor:
        ctx.link, ctx.dims = link, (split_dim, cat_dim)
        return _exchange(x, link, split_dim, cat_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        split_dim, cat_dim = ctx.dims
        return _exchange(grad.contiguous(), ctx.link, cat_dim, split_dim), None, None, None


def exchange(x: torch.Tensor, link: SequenceLink, split_dim: int, cat_dim: int) -> torch.Tensor:
    if link.size == 1:
        return x
    return _Exchange.apply(x, link, split_dim % x.dim(), cat_dim % x.dim())
