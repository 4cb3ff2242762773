"""Config changes as dotted-key overrides of the raw config, and the single changes that lower a rank's peak.

A change is what a user would edit in `ds_config.json` ("zero_optimization.stage": 3), so the OOM explainer
prints it as written and the autotuner writes its candidates with the same `apply`. Every changed config is
parsed again, so a change the parser refuses (nvme without a path, say) is never proposed.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from ..config import Config, ConfigError
from ..config.parse import parse_config


@dataclass(frozen=True)
class Change:
    overrides: Mapping[str, Any]
    """Dotted key path -> new value."""
    description: str

    def __add__(self, other: Change) -> Change:
        return Change({**self.overrides, **other.overrides}, f"{self.description}; {other.description}")


def apply(raw: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of `raw` with each dotted key set (sections created as needed)."""
    out = copy.deepcopy(dict(raw))
    for path, value in overrides.items():
        *sections, key = path.split(".")
        node = out
        for name in sections:
            if not isinstance(node.get(name), dict):
                node[name] = {}
            node = node[name]
        node[key] = value
    return out


def parsed(raw: Mapping[str, Any], change: Change, dp_size: int) -> Config | None:
    """The changed config, or None when the parser refuses it."""
    try:
        return parse_config(apply(raw, change.overrides), dp_size=dp_size)
    except ConfigError:
        return None


def micro_batch(cfg: Config, micro: int, dp_size: int) -> Change:
    """`micro` samples per forward, the global batch held by raising the accumulation steps."""
    accumulation = cfg.train_batch_size // (micro * dp_size)
    return Change({"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulation,
                   "train_batch_size": cfg.train_batch_size},
                  f"train_micro_batch_size_per_gpu {cfg.train_micro_batch_size_per_gpu} -> {micro} with "
                  f"gradient_accumulation_steps {cfg.gradient_accumulation_steps} -> {accumulation} "
                  f"(train_batch_size stays {cfg.train_batch_size})")


def single_changes(cfg: Config, dp_size: int) -> Iterator[Change]:
    """Changes that lower the peak, cheapest in speed first: a higher stage, a smaller stage-3 window,
    a smaller micro-batch, then offloading."""
    zero = cfg.zero_optimization
    for stage in range(zero.stage + 1, 4):
        yield Change({"zero_optimization.stage": stage}, f"zero_optimization.stage {zero.stage} -> {stage}")
    if zero.stage == 3 and (zero.stage3_max_reuse_distance or zero.stage3_prefetch_bucket_size):
        yield Change({"zero_optimization.stage3_max_reuse_distance": 0, "zero_optimization.stage3_prefetch_bucket_size": 0},
                     "zero_optimization.stage3_max_reuse_distance and stage3_prefetch_bucket_size -> 0 (only the "
                     "running layer gathered)")
    micro = cfg.train_micro_batch_size_per_gpu
    for smaller in range(micro - 1, 0, -1):
        if micro % smaller == 0:
            yield micro_batch(cfg, smaller, dp_size)
    nvme_path = zero.offload_optimizer.nvme_path or zero.offload_param.nvme_path  # None: the parser drops nvme
    for device in ("cpu", "nvme"):
        for section in ("offload_optimizer", "offload_param"):
            current = getattr(zero, section).device
            if current == device:
                continue
            overrides: dict[str, Any] = {f"zero_optimization.{section}.device": device}
            if device == "nvme":
                overrides[f"zero_optimization.{section}.nvme_path"] = nvme_path
            at_stage3 = section == "offload_param" and zero.stage != 3
            if at_stage3:
                overrides["zero_optimization.stage"] = 3
            yield Change(overrides, f"zero_optimization.{section}.device {current} -> {device}"
                         + (" (at stage 3)" if at_stage3 else ""))
