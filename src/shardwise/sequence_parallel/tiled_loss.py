"""The LM head and the cross-entropy over tiles of the tokens (ALST's tiled logits + loss): the [tokens, vocab]
logits, the largest activation of a long-sequence step, never exist whole. Forward keeps each tile's loss sum
and drops its logits; backward recomputes each tile's logits for its gradients. Only the hidden states and the
labels are kept in between. The machinery, and how the head's gradients arrive, is tiled.py's.

`tiled_cross_entropy` is the mean over the tokens whose label is not `ignore_index`, over the whole input, as
`F.cross_entropy` on the full logits gives it: tiles hold different numbers of such tokens (some none), so the
tiles' sums are added and divided once by the total count, never averaged tile by tile.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F

from .tiled import TilePlan, params_of, tile_bounds, tiled_call

__all__ = ["IGNORE_INDEX", "TiledFusedLogitsLoss", "tiled_cross_entropy"]

IGNORE_INDEX = -100


def tiled_cross_entropy(hidden_states: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor],
                        labels: torch.Tensor, tiles: int, *, ignore_index: int = IGNORE_INDEX,
                        reduction: str = "mean", params: Iterable[torch.Tensor] | None = None) -> torch.Tensor:
    """`F.cross_entropy(head(hidden_states), labels)` over `tiles` tiles of the tokens ([batch, seq] flattened).

    `hidden_states` [..., hidden] and `labels` [...] are aligned position by position: pass the labels already
    shifted for next-token prediction (a causal LM's `shift_labels`). `head` maps hidden states to logits (a
    model's `lm_head`); the logits are taken in fp32 at least, as transformers' losses do. `reduction`: "mean" over the
    tokens not labelled `ignore_index` (NaN when there are none, as `F.cross_entropy`), or "sum". `params`:
    trainable tensors `head` uses, default its parameters when a module; frozen ones get no gradient.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"tiled_cross_entropy: reduction must be 'mean' or 'sum'; got {reduction!r}.")
    if hidden_states.shape[:-1] != labels.shape:
        raise ValueError(f"tiled_cross_entropy: labels {tuple(labels.shape)} must have the shape of hidden_states "
                         f"{tuple(hidden_states.shape)} without its last dimension (one label per position).")
    if labels.is_floating_point() or labels.is_complex():
        raise ValueError(f"tiled_cross_entropy: labels must be class indices (an integer tensor); got {labels.dtype}.")
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    y = labels.reshape(-1)

    def run(sliced: list[torch.Tensor], _: list[torch.Tensor]) -> torch.Tensor:
        logits = head(sliced[0])
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(logits, sliced[1], ignore_index=ignore_index, reduction="sum")

    plan = TilePlan(run=run, dims=[0, 0], bounds=tile_bounds(x.shape[0], tiles), out_dim=None,
                    name="tiled_cross_entropy")
    total = tiled_call(plan, [x, y], params=params_of(head, params)).sum()
    if reduction == "sum":
        return total
    return total / (y != ignore_index).sum()


class TiledFusedLogitsLoss:
    """DeepSpeed's `TiledFusedLogitsLoss.apply(fn, self, x, y, mask, shards, compute_params, output_reduction)`:
    `fn(self, x_tile, y_tile)` (with `mask_tile` last when `mask` is not None) over `shards` tiles of the
    flattened [batch, seq] tokens, and the "mean" or "sum" of the tiles' values.

    "mean" is DeepSpeed's: the mean of the tiles' values, which is the mean over the tokens only when every tile
    holds as many counted tokens (DeepSpeed's advice: use "sum" and divide); for a mean over the tokens that
    always holds, use `tiled_cross_entropy`. Unlike DeepSpeed, the tiles are recomputed in backward rather than
    differentiated during forward, so the head's gradients follow the incoming gradient (a scaled loss) and
    arrive once (tiled.py); and when fewer tiles than `shards` cover the tokens, the mean is over those.
    """

    @staticmethod
    def apply(fn: Callable[..., torch.Tensor], self: Any, x: torch.Tensor, y: torch.Tensor,
              mask: torch.Tensor | None, shards: int, compute_params: Iterable[torch.Tensor] | None,
              output_reduction: str) -> torch.Tensor:
        if output_reduction not in ("mean", "sum"):
            raise ValueError(f"TiledFusedLogitsLoss: output_reduction must be 'mean' or 'sum'; got "
                             f"{output_reduction!r}.")
        if x.dim() < 2 or y.dim() < 2 or x.shape[:2] != y.shape[:2]:
            raise ValueError(f"TiledFusedLogitsLoss: x and y must both be [batch, seq, ...] with the same batch and "
                             f"seq; got x {tuple(x.shape)} and y {tuple(y.shape)}.")
        if mask is not None and mask.shape != x.shape[:2]:
            raise ValueError(f"TiledFusedLogitsLoss: mask must be [batch, seq] = {tuple(x.shape[:2])}; got "
                             f"{tuple(mask.shape)}.")
        sliced = [x.reshape(-1, *x.shape[2:]), y.reshape(-1, *y.shape[2:])]
        if mask is not None:
            sliced.append(mask.reshape(-1))

        def run(tiles: list[torch.Tensor], _: list[torch.Tensor]) -> torch.Tensor:
            return fn(self, *tiles)

        plan = TilePlan(run=run, dims=[0] * len(sliced), bounds=tile_bounds(sliced[0].shape[0], shards),
                        out_dim=None, name="TiledFusedLogitsLoss")
        out = tiled_call(plan, sliced, params=params_of(self, compute_params))
        return out.mean() if output_reduction == "mean" else out.sum()
