"""Model-state memory: what the ZeRO paper's formula predicts, and what a rank actually holds.

[Note: model-state formula] With Ψ trainable elements, N data-parallel ranks, P bytes per parameter
(4 fp32, 2 fp16/bf16), G bytes per gradient and K bytes of optimizer state per element (Adam: 8 for
the two moments, plus 4 for the fp32 master copy when parameters are 16-bit):
  stage 0: (P + G + K)Ψ      stage 1: (P + G)Ψ + KΨ/N
  stage 2: PΨ + (G + K)Ψ/N   stage 3: (P + G + K)Ψ/N
With offload, the K part lives in host memory instead of on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
                  optimizer_bytes: int = 8) -> ModelStateBytes:
    """Bytes per rank for `numel` trainable elements (see [Note: model-state formula])."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage: must be 0, 1, 2 or 3; got {stage}.")
    p, g, k = param_bytes * numel, grad_bytes * numel, optimizer_bytes * numel
    return ModelStateBytes(
        params=p // world if stage >= 3 else p,
        grads=g // world if stage >= 2 else g,
        optimizer=k // world if stage >= 1 else k,
    )


def _unique_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one flat buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def measured_bytes(strategy: object) -> ModelStateBytes:
    """Bytes of trainable parameters, persistent gradient buffers and optimizer-side state this rank holds."""
    units = getattr(strategy, "units", None)
    if units is not None:  # stage 3: the parameters are the units' slices (and full copies kept resident)
        params = [u.shard for u in units if u.master is not None]
        params += [u.full for u in units if u.persistent and u.master is not None]
    else:
        params = [p for p in strategy.module.parameters() if p.requires_grad]  # type: ignore[attr-defined]
    param_ptrs = {t.untyped_storage().data_ptr() for t in params}
    grads = [b.shard_grad for b in strategy.buckets.buckets]  # type: ignore[attr-defined]
    masters = [m for m in strategy.masters if m.untyped_storage().data_ptr() not in param_ptrs]  # type: ignore[attr-defined]
    state = [v for s in strategy.optimizer.state.values() for v in s.values()  # type: ignore[attr-defined]
             if isinstance(v, torch.Tensor) and v.numel() > 1]
    offload = getattr(strategy, "offload", None)
    home = getattr(strategy, "param_home", None)
    return ModelStateBytes(_unique_bytes(params), _unique_bytes(grads), _unique_bytes(masters) + _unique_bytes(state),
                           optimizer_offloaded=bool(getattr(offload, "offloaded", False)),
                           params_offloaded=bool(getattr(home, "offloaded", False)))


def estimate_model_states_memory(model: torch.nn.Module, num_gpus: int = 1, num_nodes: int = 1, stage: int = 2,
                                 offload: bool = False, mixed_precision: bool = True) -> dict[str, int]:
    """Expected model-state bytes per rank for Adam training of `model` (prints a line, returns the figures)."""
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return _report(numel, num_gpus * num_nodes, stage, offload, mixed_precision)


def _report(numel: int, world: int, stage: int, offload: bool, mixed: bool) -> dict[str, int]:
    width = 2 if mixed else 4
    est = formula_bytes(numel, world, stage, width, width, 12 if mixed else 8)
    device = est.params + est.grads + (0 if offload else est.optimizer)
    host = est.optimizer if offload else 0
    print(f"stage {stage}, {world} rank(s), {numel / 1e6:.1f}M params, {'mixed' if mixed else 'fp32'}"
          f"{', offload' if offload else ''}: {device / 2**30:.2f} GiB device + {host / 2**30:.2f} GiB host per rank")
    return {"params": est.params, "grads": est.grads, "optimizer": est.optimizer, "device": device, "host": host}
