"""DeepSpeed's curriculum-learning surface of the engine, mixed into `Engine`: the legacy seqlen curriculum
applied at each forward, the accessors scripts call, and `deepspeed_io` (the training loader, a curriculum
loader when `data_efficiency.data_sampling.curriculum_learning` is on).

Its state is made on first use and kept in the engine's `__dict__` (not nn.Module attributes), so the
engine's constructor needs no change.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.data import Dataset

from ..data_efficiency.loader import CurriculumLoader, PostProcess, curriculum_loader
from ..data_efficiency.seqlen import LegacyCurriculumScheduler, SeqlenCurriculum
from .data import DistributedLoader


class DataEfficiencySurface:
    config: Any
    module: torch.nn.Module
    topology: Any
    global_steps: int
    training_dataloader: Any

    # --- the legacy `curriculum_learning` section ------------------------------------------------
    def curriculum_enabled_legacy(self) -> bool:
        return self.config.curriculum_learning is not None

    def curriculum_params_legacy(self) -> dict[str, Any] | None:
        section = self.config.curriculum_learning
        return section.model_dump() if section is not None else None

    @property
    def curriculum_scheduler_legacy(self) -> LegacyCurriculumScheduler | None:
        seqlen = self._seqlen_curriculum()
        return seqlen.scheduler if seqlen is not None else None

    def _seqlen_curriculum(self) -> SeqlenCurriculum | None:
        if self.config.curriculum_learning is None:
            return None
        if "_seqlen" not in self.__dict__:
            self.__dict__["_seqlen"] = SeqlenCurriculum(self.config.curriculum_learning, self.module)
        return self.__dict__["_seqlen"]

    def _curriculum_inputs(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The forward's arguments with the legacy seqlen curriculum applied (unchanged without it)."""
        seqlen = self._seqlen_curriculum()
        if seqlen is None:
            return inputs, kwargs
        return seqlen.prepare(self.module, self.global_steps, inputs, kwargs)

    # --- the data-sampling curriculum ----------------------------------------------------------
    def curriculum_learning_enabled(self) -> bool:
        return self.config.data_efficiency.curriculum is not None

    def curriculum_learning_config(self) -> dict[str, Any]:
        return self.config.data_efficiency.data_sampling.curriculum_learning.model_dump()

    def data_efficiency_enabled(self) -> bool:
        return self.config.data_efficiency.enabled

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: dict[str, Callable[[int], float]]) -> None:
        """Schedule functions `step -> difficulty` for the metrics with `schedule_type: custom`."""
        if not self.curriculum_learning_enabled():
            raise ValueError("set_custom_curriculum_learning_schedule: data_efficiency.data_sampling."
                             "curriculum_learning is not enabled, so there is no metric to schedule; enable it (and "
                             "data_efficiency, data_sampling), or for the legacy section call "
                             "engine.curriculum_scheduler_legacy.set_custom_get_difficulty(fn).")
        self.__dict__["_custom_schedules"] = dict(schedule_func_dict)
        if isinstance(self.training_dataloader, CurriculumLoader):
            self.training_dataloader.set_custom_curriculum_learning_schedule(schedule_func_dict)

    def set_data_post_process_func(self, post_process_func: PostProcess) -> None:
        """`fn(batch, sampler_state)` applied to every training micro-batch (e.g. to cut a seqlen metric's
        batches to `sampler_state["current_difficulties"]["seqlen"]`)."""
        if not self.curriculum_learning_enabled():
            raise ValueError("set_data_post_process_func: the function is applied by the data-sampling curriculum's "
                             "loader, which is off (data_efficiency.data_sampling.curriculum_learning); apply it in "
                             "your loop or collate_fn instead, or enable the curriculum.")
        self.__dict__["_post_process"] = post_process_func
        if isinstance(self.training_dataloader, CurriculumLoader):
            self.training_dataloader.post_process_func = post_process_func

    def deepspeed_io(self, dataset: Dataset, batch_size: int | None = None, route: str = "train",
                     pin_memory: bool = True, data_sampler: Any = None,
                     collate_fn: Callable[[list[Any]], Any] | None = None,
                     num_local_io_workers: int | None = None) -> Any:
        """A loader over `dataset` for this engine's data-parallel rank; with route "train" it becomes the
        engine's training loader (its position is saved in checkpoints)."""
        if data_sampler is not None:
            raise ValueError("deepspeed_io: data_sampler is not supported; got one. The loader samples by the "
                             "config (seeded, resumable); drop the argument.")
        train = route == "train"
        loader = build_training_loader(self.config, self.topology, dataset, collate_fn, shuffle=train,
                                       micro_batch_size=batch_size, curriculum=train,
                                       num_workers=num_local_io_workers or 0)
        if isinstance(loader, CurriculumLoader):
            if "_custom_schedules" in self.__dict__:
                loader.set_custom_curriculum_learning_schedule(self.__dict__["_custom_schedules"])
            loader.post_process_func = self.__dict__.get("_post_process")
        if train:
            self.training_dataloader = loader
        return loader


def build_training_loader(config: Any, topology: Any, dataset: Dataset, collate_fn: Any, shuffle: bool = True,
                          micro_batch_size: int | None = None, curriculum: bool = True,
                          num_workers: int = 0) -> CurriculumLoader | DistributedLoader:
    """The curriculum loader when the data-sampling curriculum is on (and `curriculum`), else the plain
    distributed loader."""
    data = topology.data
    if curriculum and config.data_efficiency.curriculum is not None:
        if micro_batch_size not in (None, config.train_micro_batch_size_per_gpu):
            raise ValueError(f"deepspeed_io: batch_size must be train_micro_batch_size_per_gpu "
                             f"({config.train_micro_batch_size_per_gpu}) under a data-sampling curriculum, whose "
                             f"global batches are train_batch_size samples; got {micro_batch_size}.")
        loader = curriculum_loader(config, data.rank, data.size, dataset, collate_fn)
        assert loader is not None  # the curriculum is on
        return loader
    return DistributedLoader(dataset, micro_batch_size or config.train_micro_batch_size_per_gpu, data.rank,
                             data.size, seed=config.seed or 0, collate_fn=collate_fn,
                             drop_last=config.dataloader_drop_last, num_workers=num_workers, shuffle=shuffle)
