"""The search space of `shardwise autotune`, read from the user's config, and the candidates in it. Pure: no
processes, no torch.

A setting is tuned where the config gives a list (or "all") in its place, DeepSpeed's form:
`"zero_optimization": {"stage": [1, 2, 3]}`, `"train_micro_batch_size_per_gpu": [2, 4, 8]`,
`"offload_optimizer": {"device": ["none", "cpu"]}`. A single value fixes it. Where the key is absent:
- ZeRO stage: 0-3 (DeepSpeed would keep stage 0);
- the micro-batch: powers of two from the config's micro-batch (or `min_train_micro_batch_size_per_gpu`) to
  `max_train_micro_batch_size_per_gpu`;
- offload: none and cpu for the optimizer (stages 1-3) and the parameters (stage 3), and nvme too where the
  config names an `nvme_path`;
- with `"fast": false`, the stage-3 knobs and the reduce bucket in `KNOBS`.

[Note: the batch the tuner holds] When the config fixes `train_batch_size`, every candidate trains that
global batch: the micro-batch must divide it per rank and the accumulation steps make up the rest, so the
fastest config found trains exactly what the user's would. Otherwise the accumulation steps stay as given
(or are tuned from a list) and the global batch follows the micro-batch, as in DeepSpeed, within
`min_train_batch_size`..`max_train_batch_size`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from ..config.autotuning import AutotuningConfig
from ..planner.changes import apply

STAGES = (0, 1, 2, 3)
OFFLOAD = ("none", "cpu", "nvme")
KNOBS: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    # key: (the stages it applies at, the values tried with "fast": false)
    "zero_optimization.reduce_bucket_size": ((0, 1, 2), (1_000_000, 10_000_000, 500_000_000)),
    "zero_optimization.stage3_prefetch_bucket_size": ((3,), (0, 5_000_000, 50_000_000)),
    "zero_optimization.stage3_max_reuse_distance": ((3,), (0, 1_000_000_000)),
    "zero_optimization.stage3_param_persistence_threshold": ((3,), (10_000, 100_000, 1_000_000)),
    "zero_optimization.stage3_max_live_parameters": ((3,), (100_000_000, 1_000_000_000)),
}
MICRO, ACCUMULATION, BATCH = "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"
OFFLOAD_OPTIMIZER, OFFLOAD_PARAM = "zero_optimization.offload_optimizer.device", "zero_optimization.offload_param.device"


class SpaceError(ValueError):
    pass


@dataclass(frozen=True)
class Candidate:
    stage: int
    micro: int
    accumulation: int
    offload_optimizer: str = "none"
    offload_param: str = "none"
    knobs: tuple[tuple[str, int], ...] = ()

    @property
    def name(self) -> str:
        """DeepSpeed's experiment names (z1_tmbspg4_gas2), with the offload devices and knobs after them."""
        parts = [f"z{self.stage}", f"tmbspg{self.micro}", f"gas{self.accumulation}"]
        if self.offload_optimizer != "none":
            parts.append(f"oo{self.offload_optimizer}")
        if self.offload_param != "none":
            parts.append(f"op{self.offload_param}")
        parts += [f"{key.rsplit('.', 1)[-1]}{value:g}" for key, value in self.knobs]
        return "_".join(parts)

    def overrides(self, dp_size: int, nvme_path: str | None) -> dict[str, Any]:
        out: dict[str, Any] = {"zero_optimization.stage": self.stage, MICRO: self.micro, ACCUMULATION: self.accumulation,
                               BATCH: self.micro * self.accumulation * dp_size, OFFLOAD_OPTIMIZER: self.offload_optimizer,
                               OFFLOAD_PARAM: self.offload_param if self.stage == 3 else "none"}
        for key, device in ((OFFLOAD_OPTIMIZER, self.offload_optimizer), (OFFLOAD_PARAM, self.offload_param)):
            if device == "nvme":
                out[key.replace(".device", ".nvme_path")] = nvme_path
        return out | dict(self.knobs)

    def with_knobs(self, knobs: Mapping[str, int]) -> Candidate:
        return Candidate(self.stage, self.micro, self.accumulation, self.offload_optimizer, self.offload_param,
                         tuple(sorted(knobs.items())))


@dataclass(frozen=True)
class Space:
    base: dict[str, Any]
    """The user's config with every list resolved away (the values candidates override)."""
    stages: tuple[int, ...]
    micro_batches: tuple[tuple[int, int], ...]
    """(micro-batch, accumulation steps) pairs, smallest micro-batch first."""
    offload_optimizer: tuple[str, ...]
    offload_param: tuple[str, ...]
    knobs: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Knobs to tune around the best candidate, with their values."""
    nvme_path: str | None = None

    def offload_modes(self, stage: int) -> list[tuple[str, str]]:
        """(optimizer, parameters) devices at `stage`, the ones that move less first."""
        optimizer = [d for d in self.offload_optimizer if stage >= 1 or d == "none"]
        params = [d for d in self.offload_param if stage == 3 or d == "none"]
        modes = [(o, p) for o in optimizer for p in params]
        return sorted(modes, key=lambda m: (OFFLOAD.index(m[1]), OFFLOAD.index(m[0])))

    def candidates(self) -> Iterator[Candidate]:
        """Every combination of stage, offload and micro-batch (knobs at the base config's values)."""
        for stage in self.stages:
            for optimizer, params in self.offload_modes(stage):
                for micro, accumulation in self.micro_batches:
                    yield Candidate(stage, micro, accumulation, optimizer, params)

    def tightest(self) -> Candidate:
        """The candidate that needs the least memory on the device, for the profiling run: the highest stage,
        the smallest micro-batch, the most offloaded to the host (not to disk, which is slow to set up)."""
        stage = max(self.stages)
        modes = self.offload_modes(stage)
        optimizer, params = ([m for m in modes if "nvme" not in m] or modes)[-1]
        return Candidate(stage, *self.micro_batches[0], optimizer, params)

    def knob_values(self, stage: int) -> dict[str, tuple[int, ...]]:
        return {k: v for k, v in self.knobs.items() if stage in KNOBS.get(k, (STAGES, ()))[0]}

    def config(self, candidate: Candidate, dp_size: int) -> dict[str, Any]:
        return apply(self.base, candidate.overrides(dp_size, self.nvme_path))


def read_space(raw: Mapping[str, Any], dp_size: int, section: AutotuningConfig) -> Space:
    """The space a user's config asks for (see the module's docstring); raises SpaceError naming the key."""
    base = copy.deepcopy(dict(raw))
    base.pop("autotuning", None)
    zero = base.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        raise SpaceError(f"zero_optimization: a section (an object) is required to tune it; got {zero!r}.")
    stages = _values("zero_optimization.stage", zero.pop("stage", "all"), STAGES)
    nvme_path = _nvme_path(zero)
    devices = OFFLOAD if nvme_path else OFFLOAD[:2]
    offload_optimizer = _values(OFFLOAD_OPTIMIZER, _pop_device(zero, "offload_optimizer"), devices)
    offload_param = _values(OFFLOAD_PARAM, _pop_device(zero, "offload_param"), devices)
    for device in (*offload_optimizer, *offload_param):
        if device == "nvme" and not nvme_path:
            raise SpaceError("zero_optimization.offload_*.device: \"nvme\" is in the space but no nvme_path is given; "
                             "add zero_optimization.offload_optimizer.nvme_path (a fast local disk).")
    knobs = {}
    for key, (_, defaults) in KNOBS.items():
        given = zero.pop(key.rsplit(".", 1)[-1], None)
        if isinstance(given, list) or given == "all" or (given is None and not section.fast):
            knobs[key] = _values(key, given if given is not None else "all", defaults, any_size=True)
        elif given is not None:
            zero[key.rsplit(".", 1)[-1]] = given
    micro_batches = _micro_batches(base, dp_size, section)
    for key in (MICRO, ACCUMULATION, BATCH):
        base.pop(key, None)
    return Space(base, stages, micro_batches, offload_optimizer, offload_param, knobs, nvme_path)


def _values(key: str, given: Any, default: tuple[Any, ...], any_size: bool = False) -> tuple[Any, ...]:
    """The values a key takes: its list, its one value, or `default` for "all". Sizes (`any_size`) may be any
    whole number; other keys one of `default`."""
    if given == "all" or given == "auto":
        return default
    values = given if isinstance(given, list) else [given]
    if not values:
        raise SpaceError(f"{key}: an empty list tunes nothing; give values, \"all\", or one value.")
    for value in values:
        size = isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer() and value >= 0
        if not (size if any_size else value in default):
            allowed = "whole numbers of elements" if any_size else f"one of {list(default)}"
            raise SpaceError(f"{key}: {value!r} is not {allowed}; use those, or \"all\".")
    return tuple(int(v) if isinstance(v, float) else v for v in values)


def _pop_device(zero: dict[str, Any], section: str) -> Any:
    value = zero.get(section)
    if not isinstance(value, dict) or "device" not in value:
        return "all"
    return value.pop("device")


def _nvme_path(zero: dict[str, Any]) -> str | None:
    for section in ("offload_optimizer", "offload_param"):
        value = zero.get(section)
        if isinstance(value, dict) and value.get("nvme_path"):
            return str(value["nvme_path"])
    return None


def _micro_batches(raw: dict[str, Any], dp_size: int, section: AutotuningConfig) -> tuple[tuple[int, int], ...]:
    """(micro-batch, accumulation) pairs (see [Note: the batch the tuner holds])."""
    micro, accumulation, batch = raw.get(MICRO), raw.get(ACCUMULATION), raw.get(BATCH)
    if isinstance(batch, int):
        if isinstance(accumulation, list):
            raise SpaceError(f"{ACCUMULATION}: a list cannot be tuned while {BATCH} ({batch}) is fixed: the "
                             f"micro-batch decides it. Drop one of the two.")
        if batch % dp_size:
            raise SpaceError(f"{BATCH} ({batch}): not divisible by the {dp_size} data-parallel ranks.")
        per_rank = batch // dp_size
        micros = _micro_values(micro, section, per_rank)
        pairs = [(m, per_rank // m) for m in micros if per_rank % m == 0]
        if not pairs:
            raise SpaceError(f"{MICRO}: none of {list(micros)} divides {BATCH} / ranks = {per_rank}; give micro-batch "
                             "sizes that do.")
        return tuple(pairs)
    steps = accumulation if isinstance(accumulation, list) else [accumulation if isinstance(accumulation, int) else 1]
    largest = section.max_train_batch_size or 2**62
    pairs = [(m, g) for m in _micro_values(micro, section, section.max_train_micro_batch_size_per_gpu) for g in steps
             if section.min_train_batch_size <= m * g * dp_size <= largest]
    if not pairs:
        raise SpaceError(f"{MICRO} x {ACCUMULATION} x {dp_size} ranks: no pair within autotuning's "
                         f"min/max_train_batch_size ({section.min_train_batch_size}..{section.max_train_batch_size}).")
    return tuple(sorted(pairs))


def _micro_values(given: Any, section: AutotuningConfig, upper: int) -> tuple[int, ...]:
    if isinstance(given, list):
        return tuple(sorted(int(v) for v in given))
    low = given if isinstance(given, int) else section.min_train_micro_batch_size_per_gpu
    high = min(upper, section.max_train_micro_batch_size_per_gpu)
    values, m = [], max(low, 1)
    while m <= high:
        values.append(m)
        m *= 2
    return tuple(values)
