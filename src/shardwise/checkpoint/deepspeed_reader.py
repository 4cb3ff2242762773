"""Read a checkpoint DeepSpeed wrote as if shardwise had written it: by parameter name and element range.

`DeepSpeedReader` answers what `CheckpointReader` answers (`meta`, `has`, `kinds`, `shape`, `read_into`,
`read_full`, buffers), so `load_checkpoint` loads a DeepSpeed checkpoint at any world size and ZeRO stage with
the same slice-by-slice resharding as its own format, and the consolidation and inference tools read one too.

[Note: DeepSpeed's flat layouts] (as DeepSpeed 0.19.8 writes them; read from the files, which record what is needed)
- ZeRO 1/2: each optimizer group's trainable parameters, in `param_shapes[g]` order and each followed by its
  `param_alignment_paddings[g][i]` (0 where absent), form one flat vector, padded at the end and cut into
  `dp_world_size` equal partitions; rank r's file holds partition r (`single_partition_of_fp32_groups[g]`, and
  each element-wise optimizer state, e.g. `base_optimizer_state.state[g].exp_avg`, in the same layout).
- ZeRO 3: each parameter is cut into `dp_world_size` equal parts of ceil(numel / world) elements (the last
  padded); rank r's file holds its part of every parameter, in `param_shapes` order over all groups, as the
  concatenation of `fp32_flat_groups` (sub-groups) and, likewise, of each optimizer state.
- Frozen parameters are in the model-states file(s) in the training dtype: whole in `module` at stages 0-2
  (the entries that are neither trainable, nor buffers, nor `shared_params` aliases of tied weights), as
  ceil(numel / world)-element parts in each rank's `frozen_param_fragments` at stage 3.
- Stage 0 keeps the whole model in `module` (training dtype) and the optimizer's own state dict.
DeepSpeed records no RNG state and no data-loader position; those start afresh.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import Any

import torch

from ..tensor_parallel.shard import take
from .deepspeed_pickle import DeepSpeedObject, load_deepspeed_file
from .errors import CheckpointError

logger = logging.getLogger(__name__)

# What DeepSpeed's engine puts in a model-states file; every other top-level key is the caller's client_state.
_ENGINE_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
    "checkpoint_parallel_dimensions", "universal_checkpoint_info",
}
_LAYER_FILE = re.compile(r"layer_(\d+)-model_states\.pt")  # a PipelineModule's layer (tensor parallelism: refused)


class _Flat:
    """Equal-or-not chunks (memory-mapped tensors) read as one flat vector."""

    def __init__(self, chunks: list[torch.Tensor]) -> None:
        self.chunks = [c.detach().reshape(-1) for c in chunks]  # DeepSpeed saves some as nn.Parameter
        self.starts = [0]
        for c in self.chunks:
            self.starts.append(self.starts[-1] + c.numel())

    @property
    def numel(self) -> int:
        return self.starts[-1]

    def read(self, lo: int, hi: int, out: torch.Tensor) -> None:
        """Copy elements [lo, hi) into the flat `out` (hi - lo elements), casting to its dtype."""
        for chunk, start in zip(self.chunks, self.starts):
            a, b = max(lo, start), min(hi, start + chunk.numel())
            if a < b:
                out[a - lo : b - lo].copy_(chunk[a - start : b - start])


class DeepSpeedReader:
    """One DeepSpeed tag folder (`global_stepN`), read by name and range (see [Note: DeepSpeed's flat layouts])."""

    origin = "deepspeed"

    def __init__(self, path: Path) -> None:
        self.path = path
        names = sorted(p.name for p in path.iterdir() if p.is_file())
        shared = sorted(n for n in names if re.fullmatch(r"mp_rank_\d+_model_states\.pt", n))
        per_rank = sorted((n for n in names if re.fullmatch(r"zero_pp_rank_\d+_mp_rank_00_model_states\.pt", n)),
                          key=_rank_of)
        if not shared and not per_rank:
            raise CheckpointError(f"{path}: no mp_rank_00_model_states.pt (or zero_pp_rank_*_mp_rank_00_"
                                  "model_states.pt at ZeRO-3); the DeepSpeed checkpoint is incomplete.")
        first = path / (shared[0] if shared else per_rank[0])
        self.common = load_deepspeed_file(first)
        expect_keys(first, self.common, ("module", "global_steps"))
        self.pipe = _pipeline_degree(path, names, self.common, len(shared))
        self.world = int(self.common.get("dp_world_size", 1))
        config = self.common.get("ds_config") or {}
        optim = {s: sorted((n for n in names if re.fullmatch(rf"(bf16_)?zero_pp_rank_\d+_mp_rank_{s:02d}_optim_states\.pt", n)),
                           key=_rank_of) for s in range(self.pipe)}
        self.stage = _stage(path, config, optim[0], bool(per_rank))
        if self.stage > 0:
            for names_of_stage in optim.values():
                _check_ranks(path, names_of_stage, self.world, "optim_states")
        if self.stage == 3:
            _check_ranks(path, per_rank, self.world, "model_states")
        # per pipeline stage (one without a pipeline): its model states and each data-parallel rank's optimizer part
        self._stages = [(self.common if s == 0 else load_deepspeed_file(path / f"mp_rank_{s:02d}_model_states.pt"),
                         [load_deepspeed_file(path / n) for n in optim[s]] if self.stage > 0 else [])
                        for s in range(self.pipe)]
        self._optim = self._stages[0][1]
        if self.pipe > 1 or any(_LAYER_FILE.fullmatch(n) for n in names):
            self.common["module"] = _layers(path, names)  # a pipeline's weights are in its layer files
        self._models = [self.common] + [load_deepspeed_file(path / n) for n in per_rank[1:]] if self.stage == 3 else [self.common]
        self._cached_whole: tuple[tuple[str, str], torch.Tensor] | None = None
        self.bound = False  # stage 0: whether bind_stage0 has placed the optimizer state (deepspeed_stage0.py)
        self._index()
        self.meta = self._meta(config)

    # -- where each parameter is ---------------------------------------------------------------------------
    def _index(self) -> None:
        common = self.common
        module: dict[str, torch.Tensor] = common["module"]
        buffers = [n for states, _ in self._stages for n in states.get("buffer_names") or []]
        self.buffers = {n: module[n] for n in buffers if n in module}
        frozen = dict(common.get("frozen_param_shapes") or {})
        groups = common.get("param_shapes")
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.trainable: dict[str, bool] = {}
        self._where: dict[str, Any] = {}  # name -> the stage's own address of its values
        self._states: list[str] = []
        if self.stage == 0:
            self._index_stage0(module, buffers)
            return
        if not groups:
            raise CheckpointError(f"{self.path}: the model states have no param_shapes; this DeepSpeed checkpoint "
                                  "cannot be read by name.")
        if self.stage in (1, 2):
            self._index_stage12([(states["param_shapes"], opt) for states, opt in self._stages])
        else:
            self._index_stage3(groups)
        if self.stage < 3:  # stage 1 records no frozen_param_shapes: the frozen are the module's other entries
            aliases = set(common.get("shared_params") or ())
            frozen = {n: v.shape for n, v in module.items()
                      if n not in self.shapes and n not in self.buffers and n not in aliases}
        for name, shape in frozen.items():
            self.shapes[name], self.trainable[name] = tuple(shape), False

    def _index_stage12(self, stages: list[tuple[list[dict[str, Any]], list[dict[str, Any]]]]) -> None:
        """Each pipeline stage's (or the one model's) optimizer groups: (param_shapes, each rank's optimizer file)."""
        self._masters, self._state_flats, self._groups = [], {}, []
        for groups, files in stages:
            opt = [o["optimizer_state_dict"] for o in files]
            base = [o["base_optimizer_state"]["state"] for o in opt]
            if not self._groups:
                self._states, self._scalar_state = tensor_keys(base[0].get(0, {})), base[0]
            paddings = opt[0].get("param_alignment_paddings") or [None] * len(groups)
            for g, shapes in enumerate(groups):
                flat = len(self._masters)
                self._masters.append(_Flat([o["single_partition_of_fp32_groups"][g] for o in opt]))
                for key in self._states:
                    self._state_flats.setdefault(key, []).append(_Flat([b[g][key] for b in base]))
                self._groups.append(list(shapes))
                offset = 0
                for (name, shape), pad in zip(shapes.items(), paddings[g] or [0] * len(shapes)):
                    self.shapes[name], self.trainable[name] = tuple(shape), True
                    self._where[name] = (flat, offset)
                    offset += math.prod(shape) + pad
                if offset > self._masters[flat].numel:
                    raise CheckpointError(f"{self.path}: optimizer group {g} holds {self._masters[flat].numel} elements"
                                          f" over {self.world} ranks, its parameters need {offset}; the files do not "
                                          "match.")

    def _index_stage3(self, groups: list[dict[str, Any]]) -> None:
        opt = [o["optimizer_state_dict"] for o in self._optim]
        self._masters = [_Flat(list(o["fp32_flat_groups"])) for o in opt]  # one per rank
        states = [o["optimizer_state_dict"]["state"] for o in opt]
        self._states = tensor_keys(states[0].get(0, {}))
        self._state_flats = {key: [_Flat([s[i][key] for i in sorted(s)]) for s in states] for key in self._states}
        self._scalar_state = states[0]
        self._groups = [list(shapes) for shapes in groups]
        offset = 0
        for shapes in groups:
            for name, shape in shapes.items():
                numel = math.prod(shape)
                part = math.ceil(numel / self.world)
                self.shapes[name], self.trainable[name] = tuple(shape), True
                self._where[name] = (offset, part)
                offset += part
        if offset > self._masters[0].numel:
            raise CheckpointError(f"{self.path}: each rank holds {self._masters[0].numel} elements, its parts of the "
                                  f"parameters need {offset}; the files do not match.")

    def _index_stage0(self, module: dict[str, torch.Tensor], buffers: list[str]) -> None:
        """Stage 0 records no optimizer-group layout by name: the weights load; the optimizer state is
        refused (see `read_into`)."""
        frozen = set(self.common.get("frozen_param_shapes") or ())
        for name, value in module.items():
            if name in buffers:
                continue
            self.shapes[name], self.trainable[name] = tuple(value.shape), name not in frozen

    # -- CheckpointReader's interface ------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self.shapes

    def kinds(self, name: str) -> set[str]:
        if not self.trainable[name]:
            return {"value"}
        return {"master"} | ({f"state.{k}" for k in self._states} if self.stage > 0 or self.bound else set())

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def read_into(self, name: str, kind: str, start: int, end: int, out: torch.Tensor, shard: Any = None) -> None:
        """Elements [start, end) of `name`'s `kind`; with `shard`, of this rank's tensor-parallel piece of it, cut
        from the whole parameter (kept while its ranges are read: one parameter at a time)."""
        if shard is not None:
            if self._cached_whole is None or self._cached_whole[0] != (name, kind):
                self._cached_whole = ((name, kind), self.read_full(name, kind))
            out.copy_(take(self._cached_whole[1], shard).reshape(-1)[start:end])
            return
        self._read_range(name, kind, start, end, out)

    def _read_range(self, name: str, kind: str, start: int, end: int, out: torch.Tensor) -> None:
        if kind == "value" or (self.stage == 0 and not self.bound):
            out.copy_(self._whole_value(name).reshape(-1)[start:end])
            return
        flats = self._masters if kind == "master" else self._state_flats[kind.removeprefix("state.")]
        if self.stage < 3:
            group, offset = self._where[name]
            flats[group].read(offset + start, offset + end, out)
            return
        offset, part = self._where[name]
        for rank in range(start // part, (end - 1) // part + 1 if end > start else 0):
            lo, hi = max(start, rank * part), min(end, (rank + 1) * part)
            flats[rank].read(offset + lo - rank * part, offset + hi - rank * part, out[lo - start : hi - start])

    def _whole_value(self, name: str) -> torch.Tensor:
        """A frozen parameter (or, at stage 0, any parameter) as saved, whole."""
        if self.stage == 3:
            parts = [m["frozen_param_fragments"][name].detach().reshape(-1) for m in self._models]
            return torch.cat(parts)[: math.prod(self.shapes[name])].view(self.shapes[name])
        return self.common["module"][name].detach()

    def stored_dtype(self, name: str) -> torch.dtype:
        """The dtype a frozen parameter was saved in (the training dtype)."""
        if self.stage == 3:
            return self._models[0]["frozen_param_fragments"][name].dtype
        return self.common["module"][name].dtype

    def read_full(self, name: str, kind: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out = torch.empty(math.prod(self.shapes[name]), dtype=dtype)
        self._read_range(name, kind, 0, out.numel(), out)
        return out.view(self.shapes[name])

    def buffer(self, name: str) -> torch.Tensor:
        return self.buffers[name]

    def buffer_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.buffers[name].shape)

    def rank_local(self, rank: int) -> dict[str, torch.Tensor]:
        return {}

    def rng(self, rank: int) -> None:
        return None

    def _saved_param_groups(self) -> list[dict[str, Any]]:
        groups = self._optim[0]["optimizer_state_dict"]
        saved = groups["base_optimizer_state"] if self.stage in (1, 2) else groups["optimizer_state_dict"]
        return list(saved["param_groups"])

    # -- the manifest-like summary -------------------------------------------------------------------------
    def _meta(self, config: dict[str, Any]) -> dict[str, Any]:
        common = self.common
        micro = int(config.get("train_micro_batch_size_per_gpu") or 1)
        accum = int(config.get("gradient_accumulation_steps") or 1)
        batch = int(config.get("train_batch_size") or micro * accum * self.world)
        steps = int(common.get("global_steps") or 0)
        return {
            "origin": self.origin,
            "deepspeed_version": str(common.get("ds_version", "unknown")),
            "world_size": self.world,
            "topology": {"data": self.world, "pipe": self.pipe},
            "stage": self.stage,
            "config": {"train_batch_size": batch, "train_micro_batch_size_per_gpu": micro,
                       "gradient_accumulation_steps": accum,
                       "gradient_clipping": float(config.get("gradient_clipping", 1.0)),  # DeepSpeed's default
                       "fp16": dict(config.get("fp16") or {}), "bf16": dict(config.get("bf16") or {})},
            "counters": {"global_steps": steps, "global_samples": int(common.get("global_samples") or 0),
                         "skipped_steps": int(common.get("skipped_steps") or 0), "micro_steps": steps * accum,
                         "window_micro_steps": 0},
            "data_loader": None,
            "loss_scaler": self._loss_scaler(),
            "lr_scheduler": common.get("lr_scheduler"),
            "client_state": {k: v for k, v in common.items() if k not in _ENGINE_KEYS},
            "params": {n: {"shape": list(s), "trainable": self.trainable[n]} for n, s in self.shapes.items()},
            "buffers": list(self.buffers),
            "persistent_buffers": list(self.buffers),
            "optimizer": self._optimizer_meta(config),
            # DeepSpeed keeps frozen parameters unless saved with exclude_frozen_parameters=True (as Hugging Face's
            # Trainer saves a peft model): none found means none were saved, by design.
            "frozen_parameters_excluded": all(self.trainable.values()),
            "shared_params": dict(common.get("shared_params") or {}),
        }

    def _loss_scaler(self) -> dict[str, Any]:
        if self.stage > 0:
            scaler = self._optim[0]["optimizer_state_dict"].get("loss_scaler")
            return self._scaler_state(vars(scaler) if isinstance(scaler, DeepSpeedObject) else {})
        return self._scaler_state(self.common.get("optimizer") or {})

    @staticmethod
    def _scaler_state(state: dict[str, Any]) -> dict[str, Any]:
        """DeepSpeed's loss scaler in shardwise's terms (an empty dict where it has none: bf16, fp32)."""
        if not state.get("dynamic", state.get("dynamic_loss_scale", False)):
            return {}
        return {"scale": float(state["cur_scale"]), "iteration": int(state["cur_iter"]),
                "last_overflow_iteration": int(state["last_overflow_iter"]),
                "hysteresis_left": int(state.get("cur_hysteresis", 1))}

    def _optimizer_meta(self, config: dict[str, Any]) -> dict[str, Any]:
        kind = (config.get("optimizer") or {}).get("type")
        if self.stage == 0:
            return {"type": None, "deepspeed_type": kind, "param_groups": [], "scalars": {}}
        steps = [int(s["step"]) for s in self._scalar_state.values() if "step" in s]
        return {"type": None, "deepspeed_type": kind, "param_groups": hyper_parameters(self._saved_param_groups()),
                "scalars": step_scalars(self.path, steps), "groups": self._groups}


def hyper_parameters(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """DeepSpeed's optimizer groups as a manifest records them: no parameters, no per-group step counter."""
    return [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k not in ("params", "step")}
            for g in groups]


def step_scalars(path: Path, steps: list[int]) -> dict[str, float]:
    """The manifest's optimizer scalars from the step count of each group (or parameter): shardwise keeps one."""
    distinct = sorted(set(steps))
    if len(distinct) > 1:
        raise CheckpointError(f"{path}: the optimizer state was stepped different numbers of times ({distinct}); "
                              "shardwise keeps one step count for all of it.")
    return {"step": float(distinct[0])} if distinct else {}


def tensor_keys(state: dict[str, Any]) -> list[str]:
    """The element-wise entries of one optimizer state (exp_avg, ...): tensors with a dimension, not the step."""
    return sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0)


def _rank_of(name: str) -> int:
    return int(re.search(r"zero_pp_rank_(\d+)", name).group(1))  # type: ignore[union-attr]


def expect_keys(path: Path, data: dict[str, Any], keys: tuple[str, ...]) -> None:
    missing = [k for k in keys if k not in data]
    if missing:
        raise CheckpointError(f"{path}: has no {', '.join(map(repr, missing))}; it is not a DeepSpeed "
                              "model-states file.")


def _stage(path: Path, config: dict[str, Any], optim_names: list[str], per_rank_models: bool) -> int:
    stage = (config.get("zero_optimization") or {}).get("stage")
    if stage is None:
        stage = 3 if per_rank_models else (2 if optim_names else 0)
    stage = int(stage)
    if stage > 0 and not optim_names:
        raise CheckpointError(f"{path}: a ZeRO-{stage} DeepSpeed checkpoint without its *_optim_states.pt files; "
                              "it is incomplete.")
    return stage


def _check_ranks(path: Path, names: list[str], world: int, what: str) -> None:
    ranks = [_rank_of(n) for n in names]
    if ranks != list(range(world)):
        raise CheckpointError(f"{path}: DeepSpeed saved at data-parallel size {world}, so it holds {world} "
                              f"zero_pp_rank_*_{what}.pt files (ranks 0-{world - 1}); found ranks {ranks}. The "
                              "checkpoint is incomplete.")


def _pipeline_degree(path: Path, names: list[str], common: dict[str, Any], files: int) -> int:
    """How many pipeline stages saved (one mp_rank_XX model-states file each); tensor parallelism is refused."""
    dims = common.get("checkpoint_parallel_dimensions") or {}
    pipe, tensor = int(dims.get("pp_degree", 1)), int(dims.get("tp_degree", 1))
    if tensor > 1 or (files > 1 and files != pipe):
        raise CheckpointError(f"{path}: a DeepSpeed checkpoint with model (tensor) parallelism ({files} mp_rank "
                              "files); shardwise does not read that layout yet. Convert it with DeepSpeed's "
                              "ds_to_universal.py and load the universal folder, or resume with DeepSpeed.")
    if pipe > 1 and files < pipe:
        raise CheckpointError(f"{path}: saved by {pipe} pipeline stages, but holds {files} mp_rank_XX_model_states.pt "
                              "files; the checkpoint is incomplete.")
    return pipe


def _layers(path: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """A pipeline's weights and buffers, by the PipelineModule's names (`<layer index>.<name in the layer>`)."""
    module: dict[str, torch.Tensor] = {}
    for name in names:
        found = _LAYER_FILE.fullmatch(name)
        if found:
            layer = load_deepspeed_file(path / name)
            module.update({f"{int(found.group(1))}.{key}": value for key, value in layer.items()})
    return module
