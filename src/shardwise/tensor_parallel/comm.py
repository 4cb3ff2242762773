"""Megatron's communication ops as autograd functions, over the collectives choke point.

Each is the adjoint of another: what one does forward, its partner does backward.
- `copy_in`: forward identity, backward all-reduce (a column-parallel layer's input, used by every shard).
- `reduce_out`: forward all-reduce, backward identity (a row-parallel layer's partial sums).
- `gather_last`: forward all-gather along the last dim, backward this rank's slice (logits made whole).
- `split_last`: forward this rank's slice, backward all-gather.
Sequence parallelism (activations outside the split layers hold 1/size of the tokens) replaces the first two:
- `gather_seq`: forward all-gather along the sequence, backward reduce-scatter (a column-parallel input), or this
  rank's tokens where what follows is computed whole on every rank (the end of the region);
- `reduce_scatter_seq`: forward reduce-scatter along the sequence, backward all-gather (a row-parallel output);
- `scatter_seq`: forward this rank's tokens, backward all-gather (where the sequence-parallel region begins).
An all-reduce is a reduce-scatter plus an all-gather, so the bytes are the same; the memory of norms,
dropout and residuals is divided by the size.
Every collective goes through `Collectives`, so it is counted in the comms log and bounded by the timeout.
`SharedCopyIn` gives column-parallel layers that read the same tensor one `copy_in` between them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..distributed import Collectives, Group

SEQ_DIM = 1
"""Activations are [batch, sequence, hidden]."""


@dataclass(frozen=True)
class TensorLink:
    """The tensor-parallel group and the choke point its traffic goes through."""

    comm: Collectives
    group: Group

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def rank(self) -> int:
        return self.group.rank

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        tensor = tensor.detach().contiguous()
        self.comm.all_reduce(tensor, self.group, op).wait()
        return tensor

    def agrees(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is the same on every rank of the group, in one all-reduce: the maximum of (x, -x) is
        each element's largest value and its smallest, negated."""
        flat = tensor.detach().reshape(-1)
        high, negated_low = self.all_reduce(torch.cat([flat, -flat]), dist.ReduceOp.MAX).chunk(2)
        return torch.equal(high, -negated_low)

    def all_gather_dim(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        local = local.detach().contiguous()
        # a fresh flat buffer, not a view: the choke point may fill it from another thread, where a view made
        # under an autograd function's no_grad would be refused
        flat = torch.empty(self.size * local.numel(), dtype=local.dtype, device=local.device)
        self.comm.all_gather(flat, local.reshape(-1), self.group).wait()
        return torch.cat(flat.view(self.size, *local.shape).unbind(0), dim=dim)

    def reduce_scatter_dim(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        flat = torch.stack(self.chunks(full.detach(), dim)).reshape(-1)  # rank r's chunk is the r-th block
        out = torch.empty(flat.numel() // self.size, dtype=full.dtype, device=full.device)
        self.comm.reduce_scatter(out, flat, self.group).wait()
        return out.view(self.chunks(full, dim)[0].shape)

    def chunks(self, full: torch.Tensor, dim: int) -> tuple[torch.Tensor, ...]:
        n = full.shape[dim]
        if n % self.size and dim == SEQ_DIM:
            raise ValueError(f"sequence parallelism: a sequence of {n} tokens cannot be split over {self.size} "
                             f"tensor-parallel ranks; pad the sequence length to a multiple of {self.size}.")
        if n % self.size:
            raise ValueError(f"tensor parallelism: a dim of {n} cannot be split over {self.size} tensor-parallel "
                             f"ranks; make it a multiple of {self.size}.")
        return full.chunk(self.size, dim=dim)


class _CopyIn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, link: TensorLink) -> torch.Tensor:
        ctx.link = link
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.link.all_reduce(grad.clone()), None


class _ReduceOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, link: TensorLink) -> torch.Tensor:
        return link.all_reduce(x.clone())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _Gather(torch.autograd.Function):
    """All-gather along `dim`; backward reduce-scatters a partial gradient, or keeps this rank's part of a whole one."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, link: TensorLink, dim: int, partial_grad: bool) -> torch.Tensor:
        ctx.link, ctx.dim, ctx.partial_grad = link, dim, partial_grad
        return link.all_gather_dim(x, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        link = ctx.link
        if ctx.partial_grad:
            return link.reduce_scatter_dim(grad, ctx.dim), None, None, None
        return link.chunks(grad, ctx.dim)[link.rank].contiguous(), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, link: TensorLink, dim: int) -> torch.Tensor:
        ctx.link, ctx.dim = link, dim
        return link.reduce_scatter_dim(x, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.link.all_gather_dim(grad, ctx.dim), None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, link: TensorLink, dim: int) -> torch.Tensor:
        ctx.link, ctx.dim = link, dim
        return link.chunks(x, dim)[link.rank].contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.link.all_gather_dim(grad, ctx.dim), None, None


def gather_seq(x: torch.Tensor, link: TensorLink, dim: int = SEQ_DIM, partial_grad: bool = True) -> torch.Tensor:
    """`partial_grad`: the gathered tensor feeds split layers, so each rank's gradient is a partial sum (summed by
    the backward reduce-scatter); false where every rank computes the same thing from it (the gradient is then
    whole on every rank and each keeps its tokens' part)."""
    return _Gather.apply(x, link, dim, partial_grad) if link.size > 1 else x


def reduce_scatter_seq(x: torch.Tensor, link: TensorLink, dim: int = SEQ_DIM) -> torch.Tensor:
    return _ReduceScatter.apply(x, link, dim) if link.size > 1 else x


def scatter_seq(x: torch.Tensor, link: TensorLink, dim: int = SEQ_DIM) -> torch.Tensor:
    return _Scatter.apply(x, link, dim) if link.size > 1 else x


def copy_in(x: torch.Tensor, link: TensorLink) -> torch.Tensor:
    return _CopyIn.apply(x, link) if link.size > 1 else x


def reduce_out(x: torch.Tensor, link: TensorLink) -> torch.Tensor:
    return _ReduceOut.apply(x, link) if link.size > 1 else x


def gather_last(x: torch.Tensor, link: TensorLink) -> torch.Tensor:
    """The sequence ops along the last dim: what follows (the loss) is computed whole on every rank."""
    return gather_seq(x, link, dim=-1, partial_grad=False)


def split_last(x: torch.Tensor, link: TensorLink) -> torch.Tensor:
    return scatter_seq(x, link, dim=-1)


class SharedCopyIn:
    """`copy_in` shared by the column-parallel layers that read the same tensor (q/k/v, gate/up): autograd sums
    their input gradients before the one all-reduce, as Megatron's fused layers do, instead of one all-reduce
    of the same size per layer (all-reduce is linear, so the sum is the same). A copy is reused only for that
    very tensor, unmodified, in the same grad mode, until `release`: the row-parallel layer or the gathering LM
    head that closes the block calls it, so that no activation (nor its graph) is held past its block."""

    def __init__(self, link: TensorLink):
        self.link = link
        self._last: tuple[torch.Tensor, torch.Tensor, int, bool] | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.link.size == 1:
            return x
        grad = torch.is_grad_enabled()
        if self._last is not None:
            src, copied, version, grad_then = self._last
            if src is x and version == x._version and grad_then == grad:
                return copied
        copied = copy_in(x, self.link)
        self._last = (x, copied, x._version, grad)
        return copied

    def release(self) -> None:
        self._last = None
