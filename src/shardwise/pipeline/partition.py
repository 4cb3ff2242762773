"""Which layers each pipeline part holds: contiguous runs of the layer list, balanced by a weight per layer.

Pure (no torch.distributed): tested without processes. A partition is `bounds`, a list of `parts + 1`
layer indices: part `i` holds layers `bounds[i]` to `bounds[i + 1] - 1`, and every part holds at least one.
"""

from __future__ import annotations

import re
from collections.abc import Sequence


def uniform(num_layers: int, parts: int) -> list[int]:
    """Equal layer counts; the first `num_layers % parts` parts hold one more."""
    _check(num_layers, parts)
    base, extra = divmod(num_layers, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


def balanced(weights: Sequence[int], parts: int) -> list[int]:
    """Contiguous parts whose largest weight sum is as small as it can be (the pipeline's slowest stage sets
    its pace); among such, earlier parts take as much as they can. Weights are non-negative integers."""
    _check(len(weights), parts)
    if any(w < 0 for w in weights):
        raise ValueError(f"weights: non-negative values are required; got {list(weights)}.")
    lo, hi = max(weights, default=0), sum(weights)
    while lo < hi:  # the smallest bottleneck that `parts` parts can meet
        mid = (lo + hi) // 2
        if _parts_needed(weights, mid) <= parts:
            hi = mid
        else:
            lo = mid + 1
    bounds, start, n = [0], 0, len(weights)
    for part in range(parts - 1):
        end, total = start + 1, weights[start]
        while end < n - (parts - part - 1) and total + weights[end] <= lo:
            total += weights[end]
            end += 1
        bounds.append(end)
        start = end
    bounds.append(n)
    return bounds


def type_weights(class_names: Sequence[str], pattern: str) -> list[int]:
    """1 for each layer whose class name matches `pattern` (case-insensitive, anywhere in the name), else 0:
    `partition_method="type:transformer"` balances the transformer blocks and lets the rest follow."""
    try:
        regex = re.compile(pattern, re.IGNORECASE)
    except re.error as e:
        raise ValueError(f'partition_method: "type:{pattern}" is not a valid regular expression ({e}).') from None
    weights = [1 if regex.search(name) else 0 for name in class_names]
    if not any(weights):
        raise ValueError(f'partition_method: "type:{pattern}" matches no layer class (classes: '
                         f"{sorted(set(class_names))}); name a class that the layers have.")
    return weights


def _parts_needed(weights: Sequence[int], limit: int) -> int:
    parts, total = 1, 0
    for w in weights:
        if total + w > limit:
            parts, total = parts + 1, 0
        total += w
    return parts


def _check(num_layers: int, parts: int) -> None:
    if parts < 1:
        raise ValueError(f"parts: at least 1 is required; got {parts}.")
    if num_layers < parts:
        raise ValueError(f"the model has {num_layers} layers, fewer than the {parts} pipeline parts asked for; every "
                         "part needs at least one layer. Use fewer stages (or chunks), or split the model finer.")
