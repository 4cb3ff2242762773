"""The four Megatron communication ops as autograd functions, over the collectives choke point.

Each is the adjoint of another: what one does forward, its partner does backward.
- `copy_in`: forward identity, backward all-reduce (a column-parallel layer's input, used by every shard).
- `reduce_out`: forward all-reduce, backward identity (a row-parallel layer's partial sums).
- `gather_last`: forward all-gather along the last dim, backward this rank's slice (logits made whole).
- `split_last`: forward this rank's slice, backward all-gather.
Every collective goes through `Collectives`, so it is counted in the comms log and bounded by the timeout.
`SharedCopyIn` gives column-parallel layers that read the same tensor one `copy_in` between them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..distributed import Collectives, Group


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

    def all_gather_last(self, local: torch.Tensor) -> torch.Tensor:
        local = local.detach().contiguous()
        # a fresh flat buffer, not a view: the choke point may fill it from another thread, where a view made
        # under this autograd function's no_grad would be refused
        flat = torch.empty(self.size * local.numel(), dtype=local.dtype, device=local.device)
        self.comm.all_gather(flat, local.reshape(-1), self.group).wait()
        return torch.cat(flat.view(self.size, *local.shape).unbind(0), dim=-1)

    def slice_last(self, full: torch.Tensor) -> torch.Tensor:
        return full.chunk(self.size, dim=-1)[self.rank].contiguous()


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


class _GatherLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, link: TensorLink) -> torch.Tensor:
        ctx.link = link
        return link.all_gather_last(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.link.slice_last(grad), None


class _SplitLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, link: TensorLink) -> torch.Tensor:
        ctx.link = link
        return link.slice_last(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.link.all_gather_last(grad), None


def copy_in(x: torch.Tensor, link: TensorLink) -> torch.Tensor:
    return _CopyIn.apply(x, link) if link.size > 1 else x


def reduce_out(x: torch.Tensor, link: TensorLink) -> torch.Tensor:
    return _ReduceOut.apply(x, link) if link.size > 1 else x


def gather_last(x: torch.Tensor, link: TensorLink) -> torch.Tensor:
    return _GatherLast.apply(x, link) if link.size > 1 else x


def split_last(x: torch.Tensor, link: TensorLink) -> torch.Tensor:
    return _SplitLast.apply(x, link) if link.size > 1 else x


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
