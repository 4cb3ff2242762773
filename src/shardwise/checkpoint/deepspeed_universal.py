"""Read a DeepSpeed universal checkpoint (the folder `ds_to_universal.py` writes) by name and range.

Layout (DeepSpeed 0.19.8): `<tag>_universal/mp_rank_00_model_states.pt` (the engine's counters, scheduler and
`param_shapes`, as in any DeepSpeed tag folder), `zero/optimizer_state.pt` (the loss scaler, the ZeRO stage and
the optimizer's hyper-parameters), and a folder per parameter, `zero/<name>/`, holding the whole parameter
(tensor-parallel parts already merged) as `fp32.pt`, each element-wise optimizer state (`exp_avg.pt`,
`exp_avg_sq.pt`), each a dict whose `param` is the tensor, and `step.pt` (an int). Frozen parameters have
`fp32.pt` only. `latest_universal` beside the folder names it. Every file goes through the same weights-only
unpickler as the rest of DeepSpeed's (deepspeed_pickle.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .deepspeed_pickle import DeepSpeedObject, load_deepspeed_file, load_deepspeed_object
from .deepspeed_reader import DeepSpeedReader, expect_keys
from .errors import CheckpointError

_NOT_STATE = {"fp32.pt", "step.pt"}


def is_universal(folder: Path) -> bool:
    return (folder / "zero" / "optimizer_state.pt").is_file()


class UniversalReader(DeepSpeedReader):
    def __init__(self, path: Path) -> None:  # noqa: super().__init__ reads the ZeRO files a universal folder lacks
        self.path = path
        common_path = path / "mp_rank_00_model_states.pt"
        self.common = load_deepspeed_file(common_path)
        expect_keys(common_path, self.common, ("module", "global_steps", "param_shapes"))
        self.optimizer_state = load_deepspeed_file(path / "zero" / "optimizer_state.pt")
        stage = self.optimizer_state.get("zero_stage")
        self.stage = int(stage.args[0]) if isinstance(stage, DeepSpeedObject) and stage.args else 2
        self.world = int(self.common.get("dp_world_size", 1))
        self._models, self._optim, self._cached_whole = [self.common], [], None
        self._loaded: tuple[Path, torch.Tensor] | None = None
        module = self.common["module"]
        self.buffers = {n: module[n] for n in self.common.get("buffer_names") or [] if n in module}
        self.shapes, self.trainable, self.pipe = {}, {}, 1  # whole parameters, whatever layout saved them
        self._groups = [list(shapes) for shapes in self.common["param_shapes"]]
        for shapes in self.common["param_shapes"]:
            for name, shape in shapes.items():
                self.shapes[name], self.trainable[name] = tuple(shape), True
        for folder in sorted(p for p in (path / "zero").iterdir() if p.is_dir()):
            if folder.name not in self.shapes and (folder / "fp32.pt").is_file():
                self.shapes[folder.name] = tuple(self._tensor(folder / "fp32.pt").shape)
                self.trainable[folder.name] = False
        first = next((n for n, t in self.trainable.items() if t), None)
        self._states = sorted(p.stem for p in (path / "zero" / first).glob("*.pt") if p.name not in _NOT_STATE) \
            if first else []
        missing = [n for n in self.shapes if not (path / "zero" / n / "fp32.pt").is_file()]
        if missing:
            raise CheckpointError(f"{path}: no zero/<name>/fp32.pt for {missing[:10]}; the universal checkpoint is "
                                  "incomplete.")
        # each parameter's step, checked for one count by _optimizer_meta as a ZeRO file's groups' are
        self._scalar_state = {n: {"step": self._step(n)} for n, t in self.trainable.items()
                              if t and (path / "zero" / n / "step.pt").is_file()}
        self.meta = self._meta(dict(self.common.get("ds_config") or {}))
        self.meta["universal"] = True

    def _tensor(self, file: Path) -> torch.Tensor:
        """The `param` tensor of one file (the last one read is kept: a rank reads a few ranges of each in a row)."""
        if self._loaded is None or self._loaded[0] != file:
            data = load_deepspeed_file(file)
            if not isinstance(data.get("param"), torch.Tensor):
                raise CheckpointError(f"{file}: holds no 'param' tensor; it is not a universal-checkpoint file.")
            self._loaded = (file, data["param"].detach())
        return self._loaded[1]

    def _step(self, name: str) -> int:
        file = self.path / "zero" / name / "step.pt"
        step = load_deepspeed_object(file)
        if not isinstance(step, (int, float, torch.Tensor)) or isinstance(step, bool):
            raise CheckpointError(f"{file}: holds a {type(step).__name__}, not a step count.")
        return int(step)

    def _read_range(self, name: str, kind: str, start: int, end: int, out: torch.Tensor) -> None:
        file = "fp32.pt" if kind in ("master", "value") else f"{kind.removeprefix('state.')}.pt"
        tensor = self._tensor(self.path / "zero" / name / file)
        if tuple(tensor.shape) != self.shapes[name]:
            raise CheckpointError(f"{self.path / 'zero' / name / file}: shape {tuple(tensor.shape)}, the model states "
                                  f"record {self.shapes[name]}; the universal checkpoint is inconsistent.")
        out.copy_(tensor.reshape(-1)[start:end])

    def kinds(self, name: str) -> set[str]:
        return {"master", *(f"state.{k}" for k in self._states)} if self.trainable[name] else {"value"}

    def stored_dtype(self, name: str) -> torch.dtype:
        return torch.float32

    def _loss_scaler(self) -> dict[str, Any]:
        scaler = self.optimizer_state.get("loss_scaler")
        return self._scaler_state(vars(scaler) if isinstance(scaler, DeepSpeedObject) else {})

    def _saved_param_groups(self) -> list[dict[str, Any]]:
        return list(self.optimizer_state.get("param_groups") or [])
