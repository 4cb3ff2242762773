"""Write a checkpoint in DeepSpeed 0.19's layout, for DeepSpeed to resume at a given world size and ZeRO stage.

The source is any checkpoint `open_checkpoint` reads (shardwise's, or DeepSpeed's at another layout); it is
read slice by slice, one rank's partitions at a time, so the peak is one rank's share of the target layout.
What is written is what DeepSpeed's `save_checkpoint` would have written at data-parallel size `world` (see
[Note: DeepSpeed's flat layouts] in deepspeed_reader.py), with these choices where DeepSpeed's own state
differs from what a checkpoint can carry:
- ZeRO 1/2 pads each group's flat vector to a multiple of 2 × world (DeepSpeed's alignment when
  `parameter_alignment` and `round_robin_gradients` are off, their defaults); ZeRO 3 cuts sub-groups at
  `sub_group_size` partition elements, as DeepSpeed does with the same setting.
- The optimizer's groups carry the saved hyper-parameters plus FusedAdam's `bias_correction` and `step`
  (DeepSpeed's optimizer replaces its groups' entries with the saved ones), and each group's state its `step`.
- The loss scaler is DeepSpeed's LossScaler (static) or DynamicLossScaler (fp16 with dynamic scaling), named in
  the pickle without importing DeepSpeed (deepspeed_pickle.py) and rebuilt by DeepSpeed when it loads.
- No RNG state, as DeepSpeed records none.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from . import files
from .deepspeed_layout import deepspeed_files
from .deepspeed_pickle import DeepSpeedInstance, save_deepspeed_file
from .errors import CheckpointError
from .layout import MANIFEST
from .reader import open_checkpoint
from .tags import load_tag_problem

DEEPSPEED_VERSION = "0.19.8"  # the layout written; DeepSpeed refuses stage-1 files older than 0.3.17
_ZERO_STAGE = "deepspeed.runtime.zero.config.ZeroStageEnum"
_STATIC, _DYNAMIC = "deepspeed.runtime.fp16.loss_scaler.LossScaler", "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def export_deepspeed(source: str | Path, out_dir: str | Path, world: int, stage: int, source_tag: str | None = None,
                     tag: str | None = None, sub_group_size: int = 1_000_000_000, replace: bool = False,
                     latest: bool = True) -> Path:
    """Write `source` (its `latest`, or `source_tag`) to `out_dir/<tag>` in DeepSpeed's layout at data-parallel
    size `world` and ZeRO `stage` (1-3), and point `out_dir/latest` at it (unless not `latest`); returns the tag
    folder. With `replace`, an existing DeepSpeed tag folder of that name is replaced once the new one is
    complete (never anything else)."""
    if stage not in (1, 2, 3):
        raise CheckpointError(f"export: ZeRO stage {stage} is not written; DeepSpeed's stage-0 optimizer state is "
                              "recorded by position in its optimizer, not by name. Export at stage 1, 2 or 3.")
    if world < 1:
        raise CheckpointError(f"export: world size must be at least 1; got {world}.")
    reader = open_checkpoint(source, source_tag)
    plan = _Plan(reader, world, stage, sub_group_size)
    tag = tag or f"global_step{plan.meta['counters']['global_steps']}"
    problem = load_tag_problem(tag)
    if problem:
        raise CheckpointError(f"export: tag {problem}; got {tag!r}.")
    return files.write_tag_folder(Path(out_dir), tag, plan.write, "export", latest,
                                  _is_deepspeed_tag if replace else None)


def _is_deepspeed_tag(folder: Path) -> bool:
    return folder.is_dir() and not folder.is_symlink() and not (folder / MANIFEST).exists() and bool(deepspeed_files(folder))


class _Plan:
    """Where every trainable element goes in DeepSpeed's partitions, and the files' common entries."""

    def __init__(self, reader: Any, world: int, stage: int, sub_group_size: int) -> None:
        self.reader, self.meta, self.world, self.stage = reader, reader.meta, world, stage
        meta = self.meta
        split = [n for n, e in meta["params"].items() if e.get("tp")]
        if split or meta.get("topology", {}).get("pipe", 1) > 1:
            raise CheckpointError(f"{reader.path}: saved with tensor or pipeline parallelism; export to DeepSpeed's "
                                  "layout is written for data parallelism only (consolidate the weights with "
                                  "`shardwise checkpoint to-fp32` instead).")
        groups = meta["optimizer"].get("groups")
        if not groups:
            raise CheckpointError(f"{reader.path}: the checkpoint does not record which parameters each optimizer "
                                  "group holds (shardwise saves record it from this version on); load it with "
                                  "shardwise and save it again, then export.")
        trainable = {n for n, e in meta["params"].items() if e["trainable"]}
        self.groups = [[n for n in group if n in trainable] for group in groups]
        self.hyper = list(meta["optimizer"]["param_groups"])
        if len(self.hyper) == len([g for g in self.groups if g]) != len(self.groups):
            self.groups = [g for g in self.groups if g]  # the optimizer held only groups with a trainable parameter
        if len(self.hyper) != len(self.groups):
            raise CheckpointError(f"{reader.path}: {len(self.hyper)} optimizer groups of hyper-parameters for "
                                  f"{len(self.groups)} groups of parameters; the checkpoint is inconsistent.")
        if stage == 3:  # DeepSpeed's ZeRO-3 optimizer holds only groups with a trainable parameter
            kept = [i for i, g in enumerate(self.groups) if g]
            self.groups, self.hyper = [self.groups[i] for i in kept], [self.hyper[i] for i in kept]
        grouped = {n for group in self.groups for n in group}
        if trainable - grouped:
            raise CheckpointError(f"{reader.path}: trainable parameters in no optimizer group: "
                                  f"{sorted(trainable - grouped)[:10]}; the checkpoint's group record is incomplete.")
        self.frozen = [n for n, e in meta["params"].items() if not e["trainable"]]
        self.numel = {n: math.prod(e["shape"]) for n, e in meta["params"].items()}
        config = meta.get("config", {})
        fp16, bf16 = config.get("fp16") or {}, config.get("bf16") or {}
        self.precision = "fp16" if fp16.get("enabled") else "bf16" if bf16.get("enabled") else "fp32"
        self.fp16 = fp16
        first = next((n for g in self.groups for n in g), None)
        self.kinds = sorted(k for k in (reader.kinds(first) if first else ()) if k.startswith("state."))
        self.sub_group_size = sub_group_size

    # -- the files ---------------------------------------------------------------------------------------------
    def write(self, folder: Path) -> None:
        prefix = "bf16_" if self.precision == "bf16" else ""
        for rank in range(self.world):
            optim = self._zero3_optim(rank) if self.stage == 3 else self._zero12_optim(rank)
            save_deepspeed_file({"optimizer_state_dict": optim, **self._config_entries()},
                                folder / f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
            if self.stage == 3:
                save_deepspeed_file(self._model_states(rank), folder / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
        if self.stage < 3:
            save_deepspeed_file(self._model_states(None), folder / "mp_rank_00_model_states.pt")

    def _config_entries(self) -> dict[str, Any]:
        config = self.meta.get("config", {})
        ds_config: dict[str, Any] = {k: config[k] for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                                             "gradient_accumulation_steps", "gradient_clipping")
                                     if k in config}
        ds_config["zero_optimization"] = {"stage": self.stage}
        if self.precision != "fp32":
            ds_config[self.precision] = {"enabled": True}
        return {"ds_config": ds_config, "ds_version": DEEPSPEED_VERSION}

    def _model_states(self, rank: int | None) -> dict[str, Any]:
        meta, dtype = self.meta, _DTYPES[self.precision]
        module: dict[str, torch.Tensor] = OrderedDict()
        for name in self.meta["params"]:
            if rank is not None:  # stage 3: DeepSpeed's partitioned parameters are empty in the module
                module[name] = torch.empty(0, dtype=dtype)
            else:
                kind = "master" if meta["params"][name]["trainable"] else "value"
                module[name] = self.reader.read_full(name, kind).to(dtype)
        for alias, source in (meta.get("shared_params") or {}).items():
            module[alias] = module[source]
        persistent = list(meta.get("persistent_buffers", meta["buffers"]))
        for name in persistent:
            module[name] = self.reader.buffer(name).clone()
        shapes = [OrderedDict((n, torch.Size(meta["params"][n]["shape"])) for n in group) for group in self.groups]
        frozen_shapes = OrderedDict((n, torch.Size(meta["params"][n]["shape"])) for n in self.frozen)
        counters, client = meta["counters"], dict(meta.get("client_state") or {})
        excluded = bool(meta.get("frozen_parameters_excluded"))
        states: dict[str, Any] = {
            "module": module, "buffer_names": persistent, "optimizer": None, "param_shapes": shapes,
            # DeepSpeed writes these from stage 2 (its zero_to_fp32 reads them; its stage-3 load restores frozen
            # parameters from them) and leaves them out when frozen parameters are (exclude_frozen_parameters).
            "frozen_param_shapes": None if excluded else frozen_shapes,
            "shared_params": dict(meta.get("shared_params") or {}),
            "frozen_param_fragments": None if excluded else self._frozen_fragments(rank),
            "lr_scheduler": meta.get("lr_scheduler"), "data_sampler": None, "random_ltd": None,
            "skipped_steps": counters["skipped_steps"], "global_steps": counters["global_steps"],
            "global_samples": counters["global_samples"], "dp_world_size": self.world, "mp_world_size": 1,
            "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1}, **self._config_entries(),
        }
        clash = sorted(set(client) & set(states))
        if clash:
            raise CheckpointError(f"{self.reader.path}: the client state's keys {clash} are DeepSpeed's own entries "
                                  "in its model-states file; rename them before exporting.")
        return {**states, **client}

    def _frozen_fragments(self, rank: int | None) -> dict[str, torch.Tensor]:
        dtype = _DTYPES[self.precision]
        out = {}
        for name in self.frozen:
            whole = self.reader.read_full(name, "value").to(dtype).reshape(-1)
            if rank is None:
                out[name] = whole.view(self.meta["params"][name]["shape"]).clone()
            else:
                part = math.ceil(whole.numel() / self.world)
                out[name] = whole[rank * part : (rank + 1) * part].clone()
        return out

    # -- ZeRO 1/2 ----------------------------------------------------------------------------------------------
    def _zero12_optim(self, rank: int) -> dict[str, Any]:
        masters, states, paddings = [], {}, []
        for g, names in enumerate(self.groups):
            total = sum(self.numel[n] for n in names)
            padded = math.ceil(total / (2 * self.world)) * 2 * self.world
            size = padded // self.world
            lo = rank * size
            padding = size - max(0, min(total - lo, size))
            buffers = {kind: torch.zeros(size, dtype=torch.float32) for kind in ["master", *self.kinds]}
            offset = 0
            for name in names:
                a, b = max(offset, lo), min(offset + self.numel[name], lo + size)
                for kind, buf in buffers.items():
                    if a < b:
                        self.reader.read_into(name, kind, a - offset, b - offset, buf[a - lo : b - lo])
                offset += self.numel[name]
            masters.append(buffers["master"][: size - padding].clone())
            states[g] = self._state_entry(buffers)
            paddings.append(padding)
        return {
            "loss_scaler": self._loss_scaler(), "dynamic_loss_scale": self._dynamic(), "overflow": False,
            "clip_grad": float(self.meta.get("config", {}).get("gradient_clipping", 1.0)),
            "base_optimizer_state": {"state": states, "param_groups": self._param_groups([[g] for g in range(len(self.groups))])},
            "single_partition_of_fp32_groups": masters,
            "zero_stage": DeepSpeedInstance(_ZERO_STAGE, (self.stage,)),
            "group_paddings": paddings,
            "param_alignment_paddings": [[0] * len(names) for names in self.groups],
            "partition_count": [self.world] * len(self.groups),
            "ds_version": DEEPSPEED_VERSION,
        }

    # -- ZeRO 3 ------------------------------------------------------------------------------------------------
    def _zero3_optim(self, rank: int) -> dict[str, Any]:
        flats, states, members = [], {}, []
        for names in self.groups:
            members.append([])
            for sub in self._sub_groups(names):
                parts = [math.ceil(self.numel[n] / self.world) for n in sub]
                buffers = {kind: torch.zeros(sum(parts), dtype=torch.float32) for kind in ["master", *self.kinds]}
                at = 0
                for name, part in zip(sub, parts):
                    a, b = rank * part, min((rank + 1) * part, self.numel[name])
                    for kind, buf in buffers.items():
                        if a < b:
                            self.reader.read_into(name, kind, a, b, buf[at : at + b - a])
                    at += part
                members[-1].append(len(flats))
                states[len(flats)] = self._state_entry(buffers)
                flats.append(buffers["master"])
        return {
            "zero_stage": DeepSpeedInstance(_ZERO_STAGE, (3,)), "loss_scaler": self._loss_scaler(),
            "dynamic_loss_scale": self._dynamic(), "overflow": False, "partition_count": self.world,
            "optimizer_state_dict": {"state": states, "param_groups": self._param_groups(members)},
            "fp32_flat_groups": flats,
        }

    def _sub_groups(self, names: list[str]) -> list[list[str]]:
        """DeepSpeed's stage-3 sub-groups of one group: cut once their partition elements reach sub_group_size."""
        total = sum(math.ceil(self.numel[n] / self.world) for n in names)
        if self.sub_group_size >= total:
            return [names]
        subs: list[list[str]] = [[]]
        size = 0
        for name in names:
            subs[-1].append(name)
            size += math.ceil(self.numel[name] / self.world)
            if size >= self.sub_group_size and name != names[-1]:
                subs.append([])
                size = 0
        return subs

    # -- shared pieces -----------------------------------------------------------------------------------------
    def _state_entry(self, buffers: dict[str, torch.Tensor]) -> dict[str, Any]:
        step = self.meta["optimizer"]["scalars"].get("step")
        entry: dict[str, Any] = {} if step is None else {"step": int(step)}
        entry.update({kind.removeprefix("state."): buffers[kind] for kind in self.kinds})
        return entry

    def _param_groups(self, members: list[list[int]]) -> list[dict[str, Any]]:
        groups = []
        for hyper, params in zip(self.hyper, members):
            group = {k: (tuple(v) if k == "betas" else v) for k, v in hyper.items() if _plain(v)}
            group.setdefault("bias_correction", True)
            group["step"] = 0  # FusedAdam's group counter, unused by its CPU and CUDA kernels (each state has one)
            groups.append({**group, "params": params})
        return groups

    def _dynamic(self) -> bool:
        return self.precision == "fp16" and not self.fp16.get("loss_scale")

    def _loss_scaler(self) -> DeepSpeedInstance:
        if not self._dynamic():
            scale = float(self.fp16.get("loss_scale") or 1.0) if self.precision == "fp16" else 1.0
            return DeepSpeedInstance(_STATIC, (), {"cur_scale": scale, "dynamic": False})
        saved, fp16 = self.meta.get("loss_scaler") or {}, self.fp16
        hysteresis = int(fp16.get("hysteresis", 2))
        settings = {"cur_scale": float(saved.get("scale", 2.0 ** fp16.get("initial_scale_power", 16))),
                    "scale_window": int(fp16.get("loss_scale_window", 1000)),
                    "min_scale": float(fp16.get("min_loss_scale", 1.0)), "delayed_shift": hysteresis,
                    "consecutive_hysteresis": bool(fp16.get("consecutive_hysteresis", False))}
        # DynamicLossScaler(init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis), then its state
        return DeepSpeedInstance(_DYNAMIC, tuple(settings.values()), {
            **settings, "dynamic": True, "cur_iter": int(saved.get("iteration", 0)),
            "last_overflow_iter": int(saved.get("last_overflow_iteration", -1)), "scale_factor": 2.0,
            "cur_hysteresis": int(saved.get("hysteresis_left", hysteresis)), "raise_error_at_min_scale": True,
            "dtype": torch.float16,
        })


def _plain(value: Any) -> bool:
    """A hyper-parameter DeepSpeed's optimizer can hold (numbers, flags, pairs), not a tensor or an object."""
    try:
        json.dumps(value)
    except TypeError:
        return False
    return True
