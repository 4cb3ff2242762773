"""The training loader under a data-sampling curriculum: the sampler's global batches, split across
data-parallel ranks and accumulation micro-steps, collated, optionally post-processed.

Micro-step j of a global batch holds its samples [j·m·dp, (j+1)·m·dp); rank r of dp takes every dp-th of
them from position r, as `runtime/data.py`'s DistributedLoader hands out an epoch. A checkpoint keeps the
sampler's state (`state_dict`, the protocol of `checkpoint/progress.py`), which does not depend on the layout:
a run resumed at another data-parallel size or micro-batch size (same train_batch_size) reads the same
global batches. A checkpoint saved inside an accumulation window resumes with the next global batch (the
engine drops the window, see [Note: resuming under another batch layout]).

A `seqlen` metric does not cut sequences by itself: as in DeepSpeed, a post-process function does that
(`engine.set_data_post_process_func(fn)`, called as `fn(batch, sampler_state)`, whose
`current_difficulties` holds each metric's difficulty for the batch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

from torch.utils.data import Dataset
from torch.utils.data._utils.collate import default_collate

from ..config import Config
from ..config.data_efficiency import CurriculumMetricConfig, DataCurriculumConfig
from .index import MetricIndex, MetricIndexError, metric_dir
from .sampler import CurriculumSampler

PostProcess = Callable[[Any, dict[str, Any]], Any]


class CurriculumLoader:
    """Micro-batches of this rank's share of each curriculum global batch; `state_dict()` resumes it."""

    def __init__(self, dataset: Dataset, sampler: CurriculumSampler, micro_batch_size: int, dp_rank: int,
                 dp_size: int, num_epochs: int, collate_fn: Callable[[list[Any]], Any] | None = None):
        self.dataset, self.sampler = dataset, sampler
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.collate_fn = collate_fn or default_collate
        self.post_process_func: PostProcess | None = None
        self.total_steps = sampler.dataset_size * num_epochs // sampler.global_batch_size
        """Global batches in `num_epochs` passes over the dataset (DeepSpeed's bound), a partial one dropped."""

    @property
    def micro_steps_per_batch(self) -> int:
        return self.sampler.global_batch_size // (self.micro_batch_size * self.dp_size)

    def __len__(self) -> int:
        """Micro-batches this rank reads in the whole run."""
        return (self.total_steps - self.sampler.step) * self.micro_steps_per_batch

    def __iter__(self) -> Iterator[Any]:
        while self.sampler.step < self.total_steps:
            batch = self.sampler.next_global_batch()
            for ids in self.rank_micro_batches(batch):
                yield self._collate(ids)

    def rank_micro_batches(self, global_batch: Any) -> list[list[int]]:
        """This rank's sample ids of each micro-step of `global_batch`."""
        width = self.micro_batch_size * self.dp_size
        return [[int(i) for i in global_batch[j * width: (j + 1) * width][self.dp_rank:: self.dp_size]]
                for j in range(self.micro_steps_per_batch)]

    def _collate(self, ids: list[int]) -> Any:
        batch = self.collate_fn([self.dataset[i] for i in ids])
        if self.post_process_func is not None:
            batch = self.post_process_func(batch, self.state_dict())
        return batch

    def set_custom_curriculum_learning_schedule(self, functions: dict[str, Callable[[int], float]]) -> None:
        self.sampler.set_custom_schedule(functions)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "curriculum", **self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "curriculum":
            raise ValueError("data_loader: the checkpoint was saved without a data-sampling curriculum (its loader "
                             f"state is {sorted(state)}); a curriculum run cannot take up its position. Resume with "
                             "the config it was saved with, or start the curriculum from step 0.")
        self.sampler.load_state_dict(state)


def open_indexes(curriculum: DataCurriculumConfig, dataset_size: int) -> dict[str, MetricIndex | None]:
    """Each metric's index (None for `single_cluster`), checked against the dataset's size."""
    return {m: None if c.clustering_type == "single_cluster" else MetricIndex.open(m, _index_path(m, c, curriculum),
                                                                                    dataset_size)
            for m, c in curriculum.curriculum_metrics.items()}


def _index_path(metric: str, cfg: CurriculumMetricConfig, curriculum: DataCurriculumConfig) -> Path:
    paths = {metric_dir(p) for p in (cfg.index_to_sample_path, cfg.index_to_metric_path) if p}
    if len(paths) > 1:
        raise MetricIndexError(f"curriculum_metrics.{metric}: index_to_sample_path ({cfg.index_to_sample_path!r}) "
                               f"and index_to_metric_path ({cfg.index_to_metric_path!r}) must be files of one metric "
                               "directory written by DataAnalyzer; point both at it.")
    if paths:
        return paths.pop()
    if curriculum.data_cluster_path:
        return Path(curriculum.data_cluster_path) / metric
    raise MetricIndexError(f"curriculum_metrics.{metric}: no index path; set index_to_sample_path (the metric's "
                           "directory written by shardwise.data_efficiency.DataAnalyzer) or data_cluster_path.")


def curriculum_loader(config: Config, dp_rank: int, dp_size: int, dataset: Dataset,
                      collate_fn: Callable[[list[Any]], Any] | None = None) -> CurriculumLoader | None:
    """The training loader when `config.data_efficiency.curriculum` is on, else None."""
    curriculum = config.data_efficiency.curriculum
    if curriculum is None:
        return None
    size = len(dataset)  # type: ignore[arg-type]
    sampler = CurriculumSampler(curriculum, open_indexes(curriculum, size), size, config.train_batch_size,
                                config.data_efficiency.seed)
    return CurriculumLoader(dataset, sampler, config.train_micro_batch_size_per_gpu, dp_rank, dp_size,
                            config.data_efficiency.data_sampling.num_epochs, collate_fn)
