"""Checks on what a script hands the engine (the loss, the inputs), with messages that name the
problem and the fix instead of the error an operator deep inside the model would raise."""

from __future__ import annotations

from typing import Any

import torch

_DTYPE_WORDS = ("dtype", "scalar type", "datatype", "Input type")
"""Words of torch's dtype-mismatch errors ("mat1 and mat2 must have the same dtype", "Input type (double)
and bias type (float) should be the same", "expect parameter to have scalar type of Float")."""


def check_loss(loss: Any) -> None:
    """`engine.backward(loss)` needs the scalar tensor the model computed, with its gradient history."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"engine.backward(loss): loss must be the scalar tensor the model computed; got "
                        f"{type(loss).__name__} {loss!r}. Pass the loss tensor itself (not loss.item() or a number).")
    if loss.dim() != 0:
        raise ValueError(f"loss: must be a scalar tensor; got shape {tuple(loss.shape)}. Reduce it (e.g. .mean()) first.")
    if not loss.requires_grad:
        raise ValueError("engine.backward(loss): the loss must have a gradient history (requires_grad, a grad_fn); "
                         "got a tensor without one: it was computed under torch.no_grad() or torch.inference_mode(), "
                         "or from detached values. Compute it with gradients enabled (the engine's forward and the "
                         "loss outside torch.no_grad()).")


def explain_dtype_error(error: RuntimeError, inputs: tuple[Any, ...], kwargs: dict[str, Any],
                        param_dtype: torch.dtype, fp16: bool) -> str | None:
    """A dtype error in forward whose cause is a floating-point input in another dtype than the model's."""
    if not any(word in str(error) for word in _DTYPE_WORDS):
        return None
    named = [(f"argument {i}", v) for i, v in enumerate(inputs)] + [(f"argument {k!r}", v) for k, v in kwargs.items()]
    for name, value in named:
        found = _other_float(value, param_dtype)
        if found is not None:
            short = str(param_dtype).removeprefix("torch.")
            fix = f"Cast the inputs (x.to(torch.{short}))"
            if fp16:
                fix += ', or set "fp16": {"auto_cast": true} to have the engine cast floating-point inputs'
            return (f"engine(...) {name}: floating-point inputs must be in the dtype the model computes in, "
                    f"{param_dtype}; got {found}. {fix}. (torch: {error})")
    return None


def _other_float(value: Any, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype of the first floating-point tensor in `value` (nested lists, tuples, dicts) that is not `dtype`."""
    if isinstance(value, torch.Tensor):
        return value.dtype if value.is_floating_point() and value.dtype != dtype else None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    for item in items:
        found = _other_float(item, dtype)
        if found is not None:
            return found
    return None
