"""Per-rank peak memory of a training config, by parts (see [Note: the planner's model]).

[Note: the planner's model] With Ψ trainable and Φ frozen elements, N data-parallel ranks, P bytes per
parameter in the training dtype (2 under fp16/bf16, else 4) and Adam's two fp32 moments:
- model states follow ZeRO's formula (profiling/memory.py): parameters PΨ (PΨ/N at stage 3), gradients PΨ
  (PΨ/N from stage 2), fp32 master copies 4Ψ when parameters are 16-bit and optimizer state 8Ψ (both /N
  from stage 1). Offloading moves masters and state (offload_optimizer) or stage 3's slices (offload_param)
  to host memory, or to disk for nvme, which then keeps only its swap buffers in host memory;
- gradient staging: from stage 2 a gradient lives whole until its bucket is reduced into the rank's slice,
  so up to `reduce_bucket_size` elements (at most Ψ) are held beside the slices;
- ZeRO-3's window: the parameters gathered whole at once, at most `stage3_max_live_parameters`, at least
  the largest module, plus the prefetch bucket;
- activations: the traced micro-batch's saved bytes scaled to the config's micro-batch.
The peak is the sum: activations are live from the end of forward through backward, when the gradients,
the staging and the window are also live.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..config import Config
from ..config.parse import parse_config
from ..profiling.table import render_table
from ..profiling.units import binary_bytes
from ..zero.grad_buckets import COALESCE_BUCKET_BYTES, MAX_IN_FLIGHT, OVERLAP_BUCKET_BYTES, plan_launch_groups
from .shape import ActivationProfile, ModelShape

_ADAM_STATE_BYTES = 8


@dataclass(frozen=True)
class Part:
    name: str
    device: int = 0
    host: int = 0
    disk: int = 0


@dataclass(frozen=True)
class MemoryPlan:
    parts: tuple[Part, ...]
    world: int
    summary: str
    """One line naming the config: stage, dtype, offload, micro-batch."""

    @property
    def peak_device(self) -> int:
        return sum(p.device for p in self.parts)

    @property
    def peak_host(self) -> int:
        return sum(p.host for p in self.parts)

    @property
    def peak_total(self) -> int:
        """Device and host together: what one allocator holds when the device is the CPU."""
        return self.peak_device + self.peak_host

    def part(self, name: str) -> Part:
        return next(p for p in self.parts if p.name == name)

    def table(self, title: str | None = None) -> str:
        rows = [[p.name.replace("_", " "), binary_bytes(p.device), binary_bytes(p.host),
                 binary_bytes(p.disk) if p.disk else ""] for p in self.parts]
        rows.append(["peak per rank", binary_bytes(self.peak_device), binary_bytes(self.peak_host), ""])
        table = render_table(title or "Planned memory per rank", ["Part", "Device", "Host", "Disk"], rows)
        return f"{self.summary}\n{table}"

    def to_json(self) -> dict[str, Any]:
        return {"summary": self.summary, "world": self.world, "peak_device": self.peak_device,
                "peak_host": self.peak_host, "parts": {p.name: {"device": p.device, "host": p.host, "disk": p.disk}
                                                       for p in self.parts}}


def plan(shape: ModelShape, config: Config | Mapping[str, Any], world: int,
         activations: ActivationProfile | None = None, seq_len: int | None = None) -> MemoryPlan:
    """The per-rank peak of training a model of `shape` with `config` on `world` data-parallel ranks."""
    cfg = config if isinstance(config, Config) else parse_config(dict(config), dp_size=world)
    zero = cfg.zero_optimization
    stage, n = zero.stage, world
    width = 2 if (cfg.fp16.enabled or cfg.bf16.enabled) else 4
    grad_width = _grad_width(cfg)
    psi = shape.trainable
    opt_home, shard = zero.offload_optimizer.device, (n if stage >= 1 else 1)
    # fp32 parameters are their own masters, unless the optimizer or (at stage 3) the parameters move away
    # from the device: then the optimizer's fp32 slice is a separate copy where the optimizer runs. bf16
    # masters (bf16_master_weights_and_grads, never offloaded) are the bf16 parameters' own slices.
    bf16_masters = cfg.bf16.enabled and cfg.bf16.bf16_master_weights_and_grads
    params_away = stage == 3 and zero.offload_param.device != "none"
    separate = (width == 2 and not bf16_masters) or opt_home != "none" or params_away
    masters = (2 if bf16_masters else 4) * psi // shard if separate else 0
    state_bytes = _ADAM_STATE_BYTES // 2 if bf16_masters and cfg.bf16.bf16_optimizer_states else _ADAM_STATE_BYTES
    parts = [
        *_parameters(shape, cfg, n, width),
        Part("gradients", device=grad_width * psi // (n if stage >= 2 else 1)),
        _where("master_weights", masters, opt_home),
        _where("optimizer_state", state_bytes * psi // shard, opt_home),
        Part("gradient_staging", device=grad_width * _staging(shape, cfg, n)),
        Part("zero3_window", device=width * _window(shape, cfg) if stage == 3 else 0),
        Part("activations", device=activations.scaled(cfg.train_micro_batch_size_per_gpu, seq_len, width)
             if activations else 0),
    ]
    offload = [o for o in ("offload_optimizer", "offload_param") if getattr(zero, o).device != "none"]
    summary = (f"ZeRO {stage}, {'fp32' if width == 4 else 'fp16' if cfg.fp16.enabled else 'bf16'}, "
               f"micro-batch {cfg.train_micro_batch_size_per_gpu}, {n} rank(s)"
               + "".join(f", {o}={getattr(zero, o).device}" for o in offload))
    return MemoryPlan(tuple(parts), n, summary)


def _parameters(shape: ModelShape, cfg: Config, n: int, width: int) -> list[Part]:
    """Below stage 3 every rank holds the whole model. At stage 3 it holds 1/N of each unit, except units
    under `stage3_param_persistence_threshold` (norms, small layers), which stay whole on every rank and on
    the device whatever `offload_param` says."""
    if cfg.zero_optimization.stage < 3:
        return [Part("parameters", device=width * shape.total)]
    persistent = _persistent(shape, cfg)
    return [_where("parameters", width * (shape.total - persistent) // n, cfg.zero_optimization.offload_param.device),
            Part("persistent_parameters", device=width * persistent)]


def _persistent(shape: ModelShape, cfg: Config) -> int:
    threshold = cfg.zero_optimization.stage3_param_persistence_threshold
    return sum(s for s in shape.module_sizes if s < threshold)


def _grad_width(cfg: Config) -> int:
    """Bytes per accumulated gradient element: bf16 with bf16_master_weights_and_grads or a 16-bit grad_accum_dtype."""
    if cfg.bf16.enabled and cfg.bf16.bf16_master_weights_and_grads:
        return 2
    return 2 if cfg.data_types.grad_accum_dtype in ("fp16", "bf16") else 4


def _where(name: str, nbytes: int, device: str) -> Part:
    if device == "cpu":
        return Part(name, host=nbytes)
    if device == "nvme":
        return Part(name, disk=nbytes)
    return Part(name, device=nbytes)


def _staging(shape: ModelShape, cfg: Config, world: int) -> int:
    """Elements of whole gradient buffers live beside the slices (stages 2-3): `MAX_IN_FLIGHT` buckets being
    reduced and one filling; at stage 3 a bucket is a unit, launched with the next ones up to
    `COALESCE_BUCKET_BYTES` where ranks share memory (planned as if they do: on a GPU that overstates the
    staging by at most three such groups), and the persistent units form one more."""
    stage, zero = cfg.zero_optimization.stage, cfg.zero_optimization
    if stage < 2:
        return 0
    grad_width = _grad_width(cfg)
    if stage == 2:
        bucket = min(zero.reduce_bucket_size, OVERLAP_BUCKET_BYTES // grad_width)
        return min(shape.trainable, (MAX_IN_FLIGHT + 1) * bucket)
    units = [s for s in shape.module_sizes if s >= zero.stage3_param_persistence_threshold][::-1]  # backward's order
    bounds = [0, *sorted(set(plan_launch_groups(units, COALESCE_BUCKET_BYTES // grad_width if world > 1 else 0)))]
    groups = [sum(units[start:end]) for start, end in zip(bounds, bounds[1:])]
    return min(shape.trainable, _persistent(shape, cfg) + (MAX_IN_FLIGHT + 1) * max(groups, default=0))


def _window(shape: ModelShape, cfg: Config) -> int:
    """Elements gathered whole at once at stage 3. After a unit's forward it stays gathered when backward
    will use it again within `stage3_max_reuse_distance` elements of other gathers, which in backward's
    reverse order keeps the last `max_reuse_distance` elements of the forward; on top, the running unit and
    the prefetch bucket ahead of it, within `stage3_max_live_parameters`. A leaf module's units are gathered
    at once: together they count as one (leaves marked on the model, and those `stage3_module_granularity_threshold`
    will mark)."""
    zero = cfg.zero_optimization
    units = [s for s in shape.module_sizes if s >= zero.stage3_param_persistence_threshold]
    leaves = [sum(s for s in group if s >= zero.stage3_param_persistence_threshold)
              for group in shape.leaf_groups_at(zero.stage3_module_granularity_threshold)]
    total, largest = sum(units), max(units + leaves, default=0)
    kept = min(total, zero.stage3_max_reuse_distance)
    ahead = min(zero.stage3_prefetch_bucket_size, max(zero.stage3_max_live_parameters - largest, 0))
    return min(total, max(kept, largest + ahead))
