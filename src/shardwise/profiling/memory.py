"""The memory account: what the ZeRO formula predicts for the model states, what a rank actually holds
(counted from the tensors the strategy declares), and the whole breakdown with buffers, activations and
peaks. The estimator (`shardwise estimate`), the engine's `memory_breakdown()` and the tests all read these
figures, from this one place.

Tensors are counted once per storage (a gradient view into a bucket counts as part of the bucket; a tied
parameter once), by the bytes of that storage, so padding is included. Optimizer state counts the
per-element states; 0-d step counters are not model state.

[Note: model-state formula] With Ψ trainable elements, N data-parallel ranks, P bytes per parameter
(4 fp32, 2 fp16/bf16), G bytes per gradient and K bytes of optimizer state per element (Adam: 8 for
the two moments, plus 4 for the fp32 master copy when parameters are 16-bit):
  stage 0: (P + G + K)Ψ      stage 1: (P + G)Ψ + KΨ/N
  stage 2: PΨ + (G + K)Ψ/N   stage 3: (P + G + K)Ψ/N
Frozen parameters add their bytes to P's share (partitioned at stage 3 too). With offload, the K part
lives in host memory instead of on the device.
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass, fields
from typing import Iterable

import torch

from ..protocols import ShardingStrategy
from .activations import storage_key
from .table import render_table
from .units import binary_bytes

# Full-size fp32 optimizer states per parameter element.
_STATES_PER_ELEMENT = {"Adam": 2, "AdamW": 2, "Lamb": 2, "Adagrad": 1, "SGD": 1, "RMSprop": 1}


@dataclass(frozen=True)
class ModelStateBytes:
    params: int
    grads: int
    optimizer: int
    """fp32 master copies (when parameters are 16-bit) plus optimizer state."""

    optimizer_offloaded: bool = False
    """Masters and optimizer state live in host memory or on disk (offload_optimizer)."""
    params_offloaded: bool = False
    """Stage-3 parameter slices live in host memory or on disk (offload_param)."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def device(self) -> int:
        """Bytes held where the model computes."""
        return (0 if self.params_offloaded else self.params) + self.grads + (0 if self.optimizer_offloaded else self.optimizer)

    @property
    def host(self) -> int:
        """Bytes held in host memory by offloading (what is swapped to disk counts in neither)."""
        return self.total - self.device


def formula_bytes(numel: int, world: int, stage: int, param_bytes: int = 4, grad_bytes: int = 4,
                  optimizer_bytes: int = 8, frozen_bytes: int = 0, optimizer_offloaded: bool = False) -> ModelStateBytes:
    """Bytes per rank for `numel` trainable elements (see [Note: model-state formula])."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage: must be 0, 1, 2 or 3; got {stage}.")
    p, g, k = param_bytes * numel + frozen_bytes, grad_bytes * numel, optimizer_bytes * numel
    return ModelStateBytes(params=p // world if stage >= 3 else p, grads=g // world if stage >= 2 else g,
                           optimizer=k // world if stage >= 1 else k, optimizer_offloaded=optimizer_offloaded)


def adam_estimate(numel: int, world: int, stage: int, offload: bool, mixed: bool) -> ModelStateBytes:
    """The formula for Adam: 16-bit parameters and gradients with fp32 masters (`mixed`), or all fp32."""
    width = 2 if mixed else 4
    return formula_bytes(numel, world, stage, width, width, 12 if mixed else 8, optimizer_offloaded=offload)


def describe_estimate(numel: int, world: int, stage: int, offload: bool, mixed: bool) -> str:
    est = adam_estimate(numel, world, stage, offload, mixed)
    return (f"stage {stage}, {world} rank(s), {numel / 1e6:.1f}M params, {'mixed' if mixed else 'fp32'}"
            f"{', offload' if offload else ''}: {est.device / 2**30:.2f} GiB device + {est.host / 2**30:.2f} GiB host "
            "per rank")


def estimate_model_states_memory(model: torch.nn.Module, num_gpus: int = 1, num_nodes: int = 1, stage: int = 2,
                                 offload: bool = False, mixed_precision: bool = True) -> dict[str, int]:
    """Expected model-state bytes per rank for Adam training of `model`; prints one line, as DeepSpeed's
    estimators do, and returns the figures."""
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    world = num_gpus * num_nodes
    est = adam_estimate(numel, world, stage, offload, mixed_precision)
    print(describe_estimate(numel, world, stage, offload, mixed_precision))
    return {"params": est.params, "grads": est.grads, "optimizer": est.optimizer, "device": est.device,
            "host": est.host}


# --- what a rank holds ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Bytes:
    device: int = 0
    host: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host


def _tally(tensors: Iterable[torch.Tensor], seen: set[tuple[str, int]]) -> Bytes:
    """Bytes of the distinct storages behind `tensors` that are not in `seen` (which then holds them)."""
    device = host = 0
    for t in tensors:
        key = storage_key(t)
        if key in seen or t.device.type == "meta":
            continue
        seen.add(key)
        n = t.untyped_storage().nbytes()
        if t.device.type == "cpu":
            host += n
        else:
            device += n
    return Bytes(device, host)


def _optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]


def measured_bytes(strategy: ShardingStrategy) -> ModelStateBytes:
    """Bytes of trainable parameters, persistent gradient buffers and optimizer-side state this rank holds."""
    held, seen = strategy.model_state_tensors(), set()
    params = _tally(held.params, seen).total
    grads = _tally(held.grads, seen).total
    optimizer = _tally(held.masters, seen).total + _tally(_optimizer_state(strategy.optimizer), seen).total
    return ModelStateBytes(params, grads, optimizer, held.optimizer_offloaded, held.params_offloaded)


@dataclass(frozen=True)
class MemoryBreakdown:
    parameters: Bytes
    """The trained parameters as this rank stores them."""
    frozen_parameters: Bytes
    """Those that do not train (a LoRA fine-tune's base model): at stage 3 across nodes a whole copy per node
    (`node_local_frozen_weights`), partitioned within it."""
    master_weights: Bytes
    """fp32 copies the optimizer updates when the module computes in 16 bits; 0 when they are the parameters."""
    gradients: Bytes
    optimizer_state: Bytes
    buffers: Bytes
    activations_peak: int | None
    """Largest saved-for-backward bytes of one forward; None unless tracked (profiling/activations.py)."""
    device_peak: int | None
    """torch.cuda.max_memory_allocated; None on CPU."""
    host_peak_rss: int
    expected_model_states: int | None
    """The ZeRO formula for parameters + gradients + masters + optimizer state; None when the
    optimizer's state size is not known."""

    @property
    def model_states(self) -> int:
        return sum(b.total for b in self._model_state_parts())

    @property
    def model_states_on_host(self) -> int:
        """The part of `model_states` that offloading keeps in host memory."""
        return sum(b.host for b in self._model_state_parts())

    def _model_state_parts(self) -> tuple[Bytes, ...]:
        return self.parameters, self.frozen_parameters, self.master_weights, self.gradients, self.optimizer_state

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


def expected_model_states(param_bytes: int, numel: int, grad_bytes: int, master_bytes: int,
                          optimizer: torch.optim.Optimizer, stage: int, dp_size: int, state_bytes: int = 4) -> int | None:
    """The formula in bytes per rank: `param_bytes` of all parameters, and per trainable element `grad_bytes`
    of gradient, `master_bytes` of master weight and the optimizer's states of `state_bytes` each (fp32, or
    bf16 with `bf16_optimizer_states`). Optimizers not in the table give None."""
    states = _STATES_PER_ELEMENT.get(type(optimizer).__name__)
    if states is None:
        return None
    return formula_bytes(numel, dp_size, stage, 0, grad_bytes, states * state_bytes + master_bytes,
                         frozen_bytes=param_bytes).total


def memory_breakdown(strategy: ShardingStrategy, device: torch.device, stage: int, dp_size: int,
                     activations_peak: int | None = None) -> MemoryBreakdown:
    module, optimizer, held = strategy.module, strategy.optimizer, strategy.model_state_tensors()
    seen: set[tuple[str, int]] = set()
    parameters = _tally(held.params, seen)
    frozen = _tally(held.frozen, seen)
    masters = _tally(held.masters, seen)
    loose = [p.grad for p in module.parameters() if p.grad is not None]
    gradients = _tally([*held.grads, *loose], seen)
    state = _tally(_optimizer_state(optimizer), seen)
    buffers = _tally(module.buffers(), seen)
    numel = sum(whole_numel(p) for p in module.parameters() if p.requires_grad)
    param_bytes = sum(whole_numel(p) * p.element_size() for p in module.parameters())
    grad_bytes = max(held.grads, key=torch.Tensor.numel).element_size() if held.grads else 4
    # torch's optimizers keep their state in the masters' dtype: fp32, or bf16 with bf16_master_weights_and_grads.
    state_bytes = held.masters[0].element_size() if held.masters else 4
    expected = expected_model_states(param_bytes, numel, grad_bytes, state_bytes if masters.total else 0, optimizer,
                                     stage, dp_size, state_bytes)
    device_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return MemoryBreakdown(parameters, frozen, masters, gradients, state, buffers, activations_peak, device_peak, rss, expected)


def whole_numel(p: torch.Tensor) -> int:
    """A parameter's elements, also when ZeRO-3 left only a placeholder in the module (`ds_numel`): the one
    place that says so (the planner, the autotuner and ZeRO-3's leaf granularity count with it)."""
    return int(getattr(p, "ds_numel", p.numel()))


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
