"""What fills memory on this rank: bytes of parameters, master weights, gradients, optimizer state and
buffers (counted from the tensors themselves), the activations peak, the device / host peaks, next to
what the ZeRO formula expects for the model states.

Tensors are counted once per storage (a gradient view into a bucket counts as part of the bucket; a
tied parameter once), by the bytes of that storage, so padding is included.

[Note: activation bytes] Activations are the tensors autograd saves for backward. While tracking is
on, a saved-tensors hook records each one's storage during forward; the sum (parameters excluded, each
storage once) of the largest forward seen is the activations peak. Tracking costs a Python call per
saved tensor, so it runs only with `memory_breakdown: true`.
"""

from __future__ import annotations

import contextlib
import logging
import resource
from dataclasses import dataclass, fields
from typing import Any, Iterable, Iterator

import torch

from .table import render_table
from .units import binary_bytes

# Optimizer-state bytes per parameter element, per state dtype byte: the number of full-size states.
_STATES_PER_ELEMENT = {"Adam": 2, "AdamW": 2, "Lamb": 2, "Adagrad": 1, "SGD": 1, "RMSprop": 1}


@dataclass(frozen=True)
class Bytes:
    device: int = 0
    host: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host


@dataclass(frozen=True)
class MemoryBreakdown:
    parameters: Bytes
    master_weights: Bytes
    """fp32 copies the optimizer updates when the module computes in 16 bits; 0 when they are the parameters."""
    gradients: Bytes
    optimizer_state: Bytes
    buffers: Bytes
    activations_peak: int | None
    """Largest saved-for-backward bytes of one forward; None unless tracked (see [Note: activation bytes])."""
    device_peak: int | None
    """torch.cuda.max_memory_allocated; None on CPU."""
    host_peak_rss: int
    expected_model_states: int | None
    """DeepSpeed's ZeRO formula for parameters + gradients + masters + optimizer state; None when the
    optimizer's state size is not known."""

    @property
    def model_states(self) -> int:
        return sum(b.total for b in (self.parameters, self.master_weights, self.gradients, self.optimizer_state))

    def table(self) -> str:
        categories = [(f.name, getattr(self, f.name)) for f in fields(self) if isinstance(getattr(self, f.name), Bytes)]
        rows = [[name.replace("_", " "), binary_bytes(b.device), binary_bytes(b.host)] for name, b in categories]
        rows.append(["model states (sum)", binary_bytes(self.model_states), ""])
        if self.expected_model_states is not None:
            rows.append(["model states (ZeRO formula)", binary_bytes(self.expected_model_states), ""])
        if self.activations_peak is not None:
            rows.append(["activations (peak)", binary_bytes(self.activations_peak), ""])
        if self.device_peak is not None:
            rows.append(["device peak allocated", binary_bytes(self.device_peak), ""])
        rows.append(["host peak RSS", "", binary_bytes(self.host_peak_rss)])
        return render_table("Memory on this rank", ["What", "Device", "Host"], rows)


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (t.device.type, t.untyped_storage().data_ptr())


def _tally(tensors: Iterable[torch.Tensor], exclude: set[tuple[str, int]]) -> tuple[Bytes, list[torch.Tensor]]:
    """Bytes of the distinct storages behind `tensors`, skipping (and then adding to) `exclude`; and the
    tensors counted."""
    device = host = 0
    counted = []
    for t in tensors:
        key = _storage_key(t)
        if key in exclude or t.device.type == "meta":
            continue
        exclude.add(key)
        counted.append(t)
        n = t.untyped_storage().nbytes()
        if t.device.type == "cpu":
            host += n
        else:
            device += n
    return Bytes(device, host), counted


def _tensors_under(obj: Any, depth: int = 4) -> Iterator[torch.Tensor]:
    """Tensors reachable from `obj` through lists, tuples, dicts and object attributes."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth == 0 or obj is None or isinstance(obj, (str, bytes, int, float, bool, torch.nn.Module)):
        return
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_under(v, depth - 1)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            yield from _tensors_under(v, depth - 1)
    elif hasattr(obj, "__dict__"):
        for v in vars(obj).values():
            yield from _tensors_under(v, depth - 1)


def gradient_tensors(strategy: Any) -> list[torch.Tensor]:
    """The strategy's gradient storage: its `grad_buffers()` when it defines one, else the tensors under
    its `buckets`, plus any `.grad` still held by a parameter."""
    if hasattr(strategy, "grad_buffers"):
        found = list(strategy.grad_buffers())
    else:
        found = list(_tensors_under(getattr(strategy, "buckets", None)))
    found += [p.grad for p in strategy.module.parameters() if p.grad is not None]
    return found


def expected_model_states(param_bytes: int, numel: int, grad_bytes: int, master_bytes: int,
                          optimizer: torch.optim.Optimizer, stage: int, dp_size: int) -> int | None:
    """The ZeRO paper's formula, in bytes per rank: `param_bytes` of (all) parameters, and per trainable
    element `grad_bytes` of gradient, `master_bytes` of master weight and the optimizer's fp32 states.
    Stage 1 partitions optimizer state (masters included), stage 2 also gradients, stage 3 also
    parameters. Optimizers not in the table give None."""
    states = _STATES_PER_ELEMENT.get(type(optimizer).__name__)
    if states is None:
        return None
    state_dtype_bytes = 4  # optimizer states are kept in fp32
    optimizer_bytes = numel * (states * state_dtype_bytes + master_bytes)
    params, grads = param_bytes, numel * grad_bytes
    if stage >= 1:
        optimizer_bytes //= dp_size
    if stage >= 2:
        grads //= dp_size
    if stage >= 3:
        params //= dp_size
    return params + grads + optimizer_bytes


class ActivationTracker:
    """Measures saved-for-backward bytes per forward (see [Note: activation bytes])."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.peak: int | None = None

    @contextlib.contextmanager
    def track(self, module: torch.nn.Module) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        params = {_storage_key(p) for p in module.parameters()}
        seen: dict[tuple[str, int], int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = _storage_key(t)
            if key not in params:
                seen[key] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.peak = max(self.peak or 0, sum(seen.values()))


def memory_breakdown(strategy: Any, device: torch.device, stage: int, dp_size: int,
                     activations_peak: int | None = None) -> MemoryBreakdown:
    module, optimizer = strategy.module, strategy.optimizer
    seen: set[tuple[str, int]] = set()
    parameters, _ = _tally(module.parameters(), seen)
    masters, _ = _tally([p for g in optimizer.param_groups for p in g["params"]], seen)
    gradients, grads = _tally(gradient_tensors(strategy), seen)
    state, _ = _tally([v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)], seen)
    buffers, _ = _tally(module.buffers(), seen)
    numel = sum(p.numel() for p in module.parameters() if p.requires_grad)
    param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    master_bytes = 4 if masters.total else 0
    grad_bytes = max(grads, key=torch.Tensor.numel).element_size() if grads else 4
    expected = expected_model_states(param_bytes, numel, grad_bytes, master_bytes, optimizer, stage, dp_size)
    device_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return MemoryBreakdown(parameters, masters, gradients, state, buffers, activations_peak, device_peak, rss, expected)


def see_memory_usage(message: str, force: bool = False) -> None:
    """DeepSpeed's `see_memory_usage`: log the device's current and peak memory on rank 0 when `force`."""
    import torch.distributed as dist

    from .. import accelerator

    if not force or (dist.is_initialized() and dist.get_rank() != 0):
        return
    device = accelerator.get_accelerator()
    mb = 2.0**20
    logging.getLogger("shardwise").info(
        "%s | allocated %.1f MB | peak %.1f MB | reserved %.1f MB", message, device.memory_allocated() / mb,
        device.max_memory_allocated() / mb, device.memory_reserved() / mb)
