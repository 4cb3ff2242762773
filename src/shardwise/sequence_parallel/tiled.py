"""Tiled computation along the sequence (ALST's tiled MLP): a token-wise function runs over slices of the
sequence, keeping nothing but its inputs for backward, and each slice is recomputed in backward. The peak of
its activations is one tile's instead of the whole sequence's; the price is a second forward.

[Note: gradients arrive once] The parameters the function uses are inputs of the autograd function, and their
gradients, summed over the tiles, are what its backward returns. So each parameter's gradient reaches
`param.grad` once per backward through autograd's own accumulation, and the hooks that reduce gradients
(ZeRO's buckets, DDP) fire once, as they expect. (DeepSpeed instead runs a backward per tile and flags its
parameters `ds_grad_is_ready` so ZeRO waits for the last one.) It also means a parameter gets its gradient when
the tiled input itself needs none (LoRA over a frozen embedding). Frozen parameters are left out. Tensors the
function reaches that were not handed over (a closure's trainable leaf) still get theirs, summed over the tiles
and accumulated into `.grad` once at the end of the backward, as DeepSpeed's all are; `torch.autograd.grad`
does not see those, so hand them over (`params`, `compute_params`) where it is used.

ZeRO-3's partitioned parameters are refused when trainable (their gradient, made by the recompute after ZeRO
released them, has the full shape; supporting them needs ZeRO's gathers around the recompute's backward).
Frozen ones are fine: the recompute runs the modules, whose hooks gather them.

DeepSpeed's names and call signatures (`TiledMLP`, `SequenceTiledCompute`, `sequence_tiled_compute`) sit at the
end, over the same machinery.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn
from torch.autograd.function import once_differentiable

__all__ = ["SequenceTiledCompute", "TiledMLP", "sequence_tiled_compute", "tile_bounds", "tile_forward",
           "tiled_call", "tiled_mlp"]


def tile_bounds(length: int, tiles: int) -> list[tuple[int, int]]:
    """[start, stop) of each tile: `ceil(length / tiles)` positions each, the last one shorter, none empty
    (so there are fewer than `tiles` when that many would leave some empty, as with `torch.chunk`)."""
    if not isinstance(tiles, int) or isinstance(tiles, bool) or tiles < 1:
        raise ValueError(f"tiles: a positive number of tiles is required; got {tiles!r}.")
    step = max(1, math.ceil(length / tiles))
    return [(start, min(start + step, length)) for start in range(0, length, step)]


@dataclass
class TilePlan:
    """How `tiled_call` runs one call: `run(sliced, whole)` computes one tile from the tile's slices of the
    sliced tensors and the whole tensors; outputs are concatenated along `out_dim`, or stacked (scalars) when
    `out_dim` is None."""

    run: Callable[[list[torch.Tensor], list[torch.Tensor]], torch.Tensor]
    dims: Sequence[int]
    """The sequence dimension of each sliced tensor."""
    bounds: list[tuple[int, int]]
    out_dim: int | None
    name: str
    whole: int = 0
    out_sizes: list[int] = field(default_factory=list)


def tiled_call(plan: TilePlan, sliced: Sequence[torch.Tensor], whole: Sequence[torch.Tensor] = (),
               params: Iterable[torch.Tensor] = ()) -> torch.Tensor:
    """The engine under every tiled function here. `params`: the trainable tensors `run` uses besides its
    arguments; duplicates and frozen ones are dropped."""
    given = {id(t) for t in (*sliced, *whole)}
    kept: dict[int, torch.Tensor] = {}
    for p in params:
        if p is not None and p.requires_grad and id(p) not in given:
            kept[id(p)] = _not_partitioned(plan, p)
    plan.whole = len(whole)
    return _Tiled.apply(plan, *sliced, *whole, *kept.values())


class _Tiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: TilePlan, *tensors: torch.Tensor) -> torch.Tensor:
        inputs = len(plan.dims) + plan.whole
        ctx.plan = plan
        # Parameters are held, not saved: saved-tensor hooks (host offload) would copy them at every step.
        ctx.params = tensors[inputs:]
        ctx.save_for_backward(*tensors[:inputs])
        sliced, whole = list(tensors[:len(plan.dims)]), list(tensors[len(plan.dims):inputs])
        outs = [_checked(plan, plan.run(_slices(sliced, plan.dims, start, stop), whole))
                for start, stop in plan.bounds]
        if plan.out_dim is None:
            return torch.stack([out.reshape(()) for out in outs])
        plan.out_sizes = [out.shape[plan.out_dim] for out in outs]
        return torch.cat(outs, dim=plan.out_dim)

    @staticmethod
    @once_differentiable  # the recompute's gradients are not themselves differentiated: refuse a double backward
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        plan: TilePlan = ctx.plan
        n = len(plan.dims)
        saved = ctx.saved_tensors
        sliced, whole, params = list(saved[:n]), list(saved[n:]), list(ctx.params)
        needs = ctx.needs_input_grad[1:]
        sliced_grads = [torch.zeros_like(t) if needs[i] else None for i, t in enumerate(sliced)]
        sums: dict[Any, torch.Tensor] = {}
        owned: set[Any] = set()
        leaves: dict[Any, torch.Tensor] = {}
        offset = 0
        for tile, (start, stop) in enumerate(plan.bounds):
            tile_in = [s.detach().requires_grad_(needs[i])
                       for i, s in enumerate(_slices(sliced, plan.dims, start, stop))]
            whole_in = [w.detach().requires_grad_(needs[n + i]) for i, w in enumerate(whole)]
            with torch.enable_grad():
                out = plan.run(tile_in, whole_in)
            if plan.out_dim is None:
                out_grad = grad[tile].reshape(out.shape)
            else:
                out_grad = grad.narrow(plan.out_dim, offset, plan.out_sizes[tile])
                offset += plan.out_sizes[tile]
            if not out.requires_grad:
                continue
            listed = tile_in + whole_in + params
            targets = [(i, t) for i, t in enumerate(listed) if t.requires_grad]
            unlisted = [_not_partitioned(plan, leaf) for leaf in _leaves_beyond(out, listed)]
            got = torch.autograd.grad(out, [t for _, t in targets] + unlisted, out_grad, allow_unused=True)
            for (i, _), g in zip(targets, got):
                if i < n:
                    if g is not None:
                        sliced_grads[i].narrow(plan.dims[i], start, stop - start).copy_(g)
                else:
                    _accumulate(sums, owned, i, g)
            for leaf, g in zip(unlisted, got[len(targets):]):
                leaves[("leaf", id(leaf))] = leaf
                _accumulate(sums, owned, ("leaf", id(leaf)), g)
        found = [(leaf, sums[key]) for key, leaf in leaves.items() if key in sums]
        if found:  # see [Note: gradients arrive once]
            torch.autograd.backward([leaf for leaf, _ in found], [g for _, g in found])
        return (None, *sliced_grads, *(sums.get(i) for i in range(n, n + len(whole) + len(params))))


def _not_partitioned(plan: TilePlan, param: torch.Tensor) -> torch.Tensor:
    if hasattr(param, "ds_id"):
        raise ValueError(f"{plan.name}: a trainable parameter of shape {tuple(getattr(param, 'ds_shape', ()))} is "
                         "partitioned by ZeRO-3, which tiled computation does not support yet (its gradient would "
                         "come back in the full shape); use ZeRO stage 1 or 2 or leave it out of the tiled "
                         "function, or freeze it (LoRA's base weights may be partitioned).")
    return param


def _accumulate(sums: dict[Any, torch.Tensor], owned: set[Any], key: Any, g: torch.Tensor | None) -> None:
    """Sum over the tiles. The first tile's gradient is kept as autograd returned it, which may alias another
    tensor (a pass-through's incoming gradient), so the first addition makes a tensor of our own."""
    if g is None:
        return
    if key not in sums:
        sums[key] = g
    elif key in owned:
        sums[key].add_(g)
    else:
        sums[key] = sums[key] + g
        owned.add(key)


def _slices(tensors: list[torch.Tensor], dims: Sequence[int], start: int, stop: int) -> list[torch.Tensor]:
    return [t.narrow(d, start, stop - start) for t, d in zip(tensors, dims)]


def _checked(plan: TilePlan, out: Any) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{plan.name}: the tiled function must return one tensor; got {type(out).__name__}.")
    if plan.out_dim is None and out.numel() != 1:
        raise ValueError(f"{plan.name}: with outputs stacked per tile, each tile must return one value; got shape "
                         f"{tuple(out.shape)}.")
    return out


def _leaves_beyond(out: torch.Tensor, listed: list[torch.Tensor]) -> list[torch.Tensor]:
    """The trainable leaves `out` depends on besides `listed` (accumulation nodes hold them)."""
    known = {id(t) for t in listed}
    found: dict[int, torch.Tensor] = {}
    seen: set[Any] = set()
    stack = [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)
        if leaf is not None:
            if id(leaf) not in known:
                found.setdefault(id(leaf), leaf)
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(found.values())


def params_of(owner: Any, extra: Iterable[torch.Tensor] | None) -> list[torch.Tensor]:
    own = list(owner.parameters()) if isinstance(owner, nn.Module) else []
    return own + list(extra or [])


def tiled_mlp(mlp: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tiles: int,
              params: Iterable[torch.Tensor] | None = None) -> torch.Tensor:
    """`mlp(x)` for a token-wise `mlp` (each position's output depends on that position only: a transformer's
    MLP) over `tiles` slices of the sequence (`x` is [..., seq, hidden]). Only `x` is kept for backward; each
    tile is recomputed there. `params`: trainable tensors `mlp` uses, default its parameters when a module."""
    if x.dim() < 2:
        raise ValueError(f"tiled_mlp: x must be [..., seq, hidden]; got shape {tuple(x.shape)}.")
    dim = x.dim() - 2
    plan = TilePlan(run=lambda sliced, _: mlp(sliced[0]), dims=[dim], bounds=tile_bounds(x.shape[dim], tiles),
                    out_dim=dim, name="tiled_mlp")
    return tiled_call(plan, [x], params=params_of(mlp, params))


def tile_forward(module: nn.Module, tiles: int) -> nn.Module:
    """From now on `module`'s forward (one tensor in, one out, token-wise: a LLaMA MLP) runs tiled, `tiles`
    slices of the sequence. The forward is replaced on the instance, so its parameters' names, its hooks and the
    checkpoints it is saved to are unchanged; `del module.forward` undoes it."""
    if "forward" in vars(module):
        raise ValueError(f"tile_forward: {type(module).__name__}'s forward is already replaced on this instance "
                         "(tiled once already?); undo it with `del module.forward` first.")
    forward = module.forward
    tile_bounds(1, tiles)  # refuse a bad count now, not at the first forward
    module.forward = lambda x: tiled_mlp(forward, x, tiles, params=module.parameters())
    return module


# DeepSpeed's names (deepspeed.runtime.sequence_parallel.ulysses_sp), called as DeepSpeed's scripts call them.


class TiledMLP:
    """DeepSpeed's `TiledMLP.apply(fn, self, x, shards, compute_params)`: `fn(self, x)` over `shards` slices
    along `x`'s next-to-last dimension. `compute_params` are used as well as `self`'s parameters (DeepSpeed
    needs them for ZeRO only)."""

    @staticmethod
    def apply(fn: Callable[[Any, torch.Tensor], torch.Tensor], self: Any, x: torch.Tensor, shards: int,
              compute_params: Iterable[torch.Tensor] | None = None) -> torch.Tensor:
        return tiled_mlp(lambda tile: fn(self, tile), x, shards, params=params_of(self, compute_params))


class SequenceTiledCompute:
    """DeepSpeed's `SequenceTiledCompute.apply(fn, seqlen, shards, keys_to_shard, keys_to_pass,
    grad_requiring_tensor_key, compute_params, output_unshard_dimension, output_reduction, *args)`; see
    `sequence_tiled_compute`."""

    @staticmethod
    def apply(fn: Callable[..., torch.Tensor], seqlen: int, shards: int, keys_to_shard: Sequence[str],
              keys_to_pass: Sequence[str], grad_requiring_tensor_key: str,
              compute_params: Iterable[torch.Tensor] | None, output_unshard_dimension: int,
              output_reduction: str | None, *args: Any) -> torch.Tensor:
        keys_to_shard, keys_to_pass = list(keys_to_shard), list(keys_to_pass)
        if len(args) != len(keys_to_shard) + len(keys_to_pass):
            raise ValueError(f"SequenceTiledCompute: {len(args)} values for {len(keys_to_shard)} keys to shard and "
                             f"{len(keys_to_pass)} to pass; give one value per key, sharded ones first.")
        if grad_requiring_tensor_key not in keys_to_shard + keys_to_pass:
            raise ValueError(f"SequenceTiledCompute: grad_requiring_tensor_key {grad_requiring_tensor_key!r} is not "
                             f"among the keys {keys_to_shard + keys_to_pass}.")
        if output_reduction not in (None, "mean", "sum"):
            raise ValueError(f"SequenceTiledCompute: output_reduction must be None, 'mean' or 'sum'; got "
                             f"{output_reduction!r}.")
        sharded = dict(zip(keys_to_shard, args))
        passed = dict(zip(keys_to_pass, args[len(keys_to_shard):]))
        for key, value in sharded.items():
            if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[1] != seqlen:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"SequenceTiledCompute: {key!r} must be a [batch, seqlen={seqlen}, ...] tensor to "
                                 f"shard; got {shape}.")
        tensor_keys = [k for k, v in passed.items() if isinstance(v, torch.Tensor)]
        constants = {k: v for k, v in passed.items() if k not in tensor_keys}

        def run(sliced: list[torch.Tensor], whole: list[torch.Tensor]) -> torch.Tensor:
            return fn(**dict(zip(keys_to_shard, sliced)), **dict(zip(tensor_keys, whole)), **constants)

        stacked = output_unshard_dimension == 0
        plan = TilePlan(run=run, dims=[1] * len(keys_to_shard), bounds=tile_bounds(seqlen, shards),
                        out_dim=None if stacked else output_unshard_dimension, name="SequenceTiledCompute")
        out = tiled_call(plan, list(sharded.values()), [passed[k] for k in tensor_keys], params=compute_params or ())
        if output_reduction == "mean":
            return out.mean()
        return out.sum() if output_reduction == "sum" else out


def sequence_tiled_compute(fn: Callable[..., torch.Tensor], seqlen: int, shards: int,
                           kwargs_to_shard: dict[str, Any], kwargs_to_pass: dict[str, Any],
                           grad_requiring_tensor_key: str, compute_params: Iterable[torch.Tensor] | None = None,
                           output_unshard_dimension: int = 1, output_reduction: str | None = "mean") -> torch.Tensor:
    """DeepSpeed's `sequence_tiled_compute`: `fn(**kwargs_to_shard, **kwargs_to_pass)` over `shards` slices of
    dimension 1 of the tensors in `kwargs_to_shard` ([batch, seqlen, ...]); outputs concatenated along
    `output_unshard_dimension` (0: one value per tile, stacked), then reduced by `output_reduction` (None,
    "mean" or "sum").

    Unlike DeepSpeed, every input that requires grad gets its gradient, not only `grad_requiring_tensor_key`'s
    (checked to be an input), and the reductions' gradients are those of the reduced output (DeepSpeed divides
    by `shards` even where the mean is over every element). Trailing tiles that would be empty are not run.
    """
    return SequenceTiledCompute.apply(fn, seqlen, shards, list(kwargs_to_shard), list(kwargs_to_pass),
                                      grad_requiring_tensor_key, compute_params, output_unshard_dimension,
                                      output_reduction, *kwargs_to_shard.values(), *kwargs_to_pass.values())
