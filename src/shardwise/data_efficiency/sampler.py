"""The curriculum sampler: which samples make up each optimizer step's global batch under a data-sampling
curriculum (`data_efficiency.data_sampling.curriculum_learning`). Pure numpy, no process group: every rank
computes the same global batches, so no rank broadcasts them (DeepSpeed's rank 0 does).

[Note: curriculum sampling rules]
- Step k (1-based, counted by the sampler) has difficulty d_m = schedule_m(k) for every metric m. A sample is
  admitted when it is admitted by every metric (the intersection): `difficulty_type: value` admits metric
  <= d_m, `percentile` the easiest floor(N · d_m / max_difficulty) samples (all at max_difficulty); a metric
  with `clustering_type: single_cluster` admits everything.
- When the difficulties change, the samples admitted now and by no earlier cluster become a new cluster
  (none if there are none). Clusters are never removed: a difficulty that goes down admits nothing new.
- Each cluster is read in its own order, a permutation seeded by (data_efficiency.seed, cluster, pass).
  A step draws `global_batch_size` samples across clusters, how many from each by a multivariate
  hypergeometric draw over the clusters' unread samples (proportional to what is left), seeded by
  (seed, step); within a cluster it takes the next unread samples. The batch is then shuffled with the
  same generator.
- Exactly once: no sample is drawn twice until every admitted sample has been drawn in this pass. When a
  step needs more than is left, it takes all that is left, then a new pass starts (DeepSpeed's epochs):
  every cluster gets a new permutation and its cursor goes back to 0. (So a step that crosses a pass can
  hold a sample twice, once from each pass, when few samples are admitted.)
- The global batch depends on nothing but the seed, the index, the schedules and the step, never on the
  data-parallel layout; the loader splits it (`loader.py`). So the state that resumes a run exactly is small:
  the step, the pass, the difficulties at which clusters were made, and each cluster's cursor.
Differences from DeepSpeed 0.19.8: its clusters reshuffle one at a time when each runs out and are drawn
with replacement across clusters, so a sample can recur before others are seen; its checkpoint saves
numpy's global RNG state, not the sampler's own generator, so a resumed run draws other batches.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..config.data_efficiency import DataCurriculumConfig
from .index import MetricIndex
from .schedule import DifficultySchedule


class CurriculumSampler:
    """Global batches of sample ids, one per optimizer step; see [Note: curriculum sampling rules]."""

    def __init__(self, curriculum: DataCurriculumConfig, indexes: Mapping[str, MetricIndex | None],
                 dataset_size: int, global_batch_size: int, seed: int):
        self.config, self.indexes = curriculum, dict(indexes)
        self.dataset_size, self.global_batch_size, self.seed = dataset_size, global_batch_size, seed % 2**63
        self.schedules = {m: DifficultySchedule(c, f"curriculum_metrics.{m}")
                          for m, c in curriculum.curriculum_metrics.items()}
        self.step = 0
        self.passes = 0
        self.bands: list[dict[str, float]] = []
        """The difficulties at which each cluster was made, in order: they rebuild the clusters."""
        self.cursors: list[int] = []
        self.current_difficulties: dict[str, float] = {}
        self._clusters: list[np.ndarray] = []
        self._orders: list[np.ndarray] = []

    def set_custom_schedule(self, functions: Mapping[str, Any]) -> None:
        unknown = sorted(set(functions) - set(self.schedules))
        if unknown:
            raise KeyError(f"set_custom_curriculum_learning_schedule: no curriculum metric named {unknown}; the "
                           f"config's curriculum_metrics are {sorted(self.schedules)}.")
        for metric, fn in functions.items():
            self.schedules[metric].set_custom(fn)

    # --- admission -----------------------------------------------------------------------------
    def admitted(self, difficulties: Mapping[str, float]) -> np.ndarray:
        """Sorted ids of the samples every metric admits at `difficulties`."""
        result: np.ndarray | None = None
        for metric, cfg in self.config.curriculum_metrics.items():
            index = self.indexes.get(metric)
            if cfg.clustering_type == "single_cluster" or index is None:
                continue
            d = difficulties[metric]
            ids = (index.admitted_by_value(d) if cfg.difficulty_type == "value"
                   else index.admitted_by_percentile(d, cfg.max_difficulty))
            ids = np.sort(ids)
            result = ids if result is None else np.intersect1d(result, ids, assume_unique=True)
        return np.arange(self.dataset_size) if result is None else result

    def _add_cluster(self, difficulties: dict[str, float]) -> None:
        new = self.admitted(difficulties)
        for cluster in self._clusters:
            new = np.setdiff1d(new, cluster, assume_unique=True)
        if len(new):
            self.bands.append(dict(difficulties))
            self._clusters.append(new)
            self._orders.append(self._order(len(self._clusters) - 1))
            if len(self.cursors) < len(self._clusters):
                self.cursors.append(0)

    def _order(self, cluster: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, cluster, self.passes])
        return rng.permutation(self._clusters[cluster])

    # --- drawing -------------------------------------------------------------------------------
    def next_global_batch(self) -> np.ndarray:
        """Step `self.step + 1`'s global batch of sample ids (global_batch_size of them)."""
        self.step += 1
        difficulties = {m: s.difficulty(self.step) for m, s in self.schedules.items()}
        if difficulties != self.current_difficulties:
            self.current_difficulties = difficulties
            self._add_cluster(difficulties)
        if not self._clusters:
            raise ValueError(f"curriculum_learning: no sample is admitted at step {self.step} (difficulties "
                             f"{difficulties}); lower min_difficulty or check the metric index.")
        rng = np.random.default_rng([self.seed, self.step])
        batch: list[np.ndarray] = []
        need = self.global_batch_size
        while need:
            left = np.array([len(c) - cur for c, cur in zip(self._clusters, self.cursors)], dtype=np.int64)
            if left.sum() == 0:
                self._new_pass()
                continue
            counts = left if left.sum() <= need else rng.multivariate_hypergeometric(left, need)
            for k, count in enumerate(counts):
                batch.append(self._orders[k][self.cursors[k]: self.cursors[k] + count])
                self.cursors[k] += int(count)
            need -= int(counts.sum())
        drawn = np.concatenate(batch)
        rng.shuffle(drawn)
        return drawn

    def _new_pass(self) -> None:
        self.passes += 1
        self.cursors = [0] * len(self._clusters)
        self._orders = [self._order(k) for k in range(len(self._clusters))]

    # --- checkpoint ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "passes": self.passes, "bands": [dict(b) for b in self.bands],
                "cursors": list(self.cursors), "current_difficulties": dict(self.current_difficulties),
                "seed": self.seed, "dataset_size": self.dataset_size, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue exactly where `state` left off (the clusters are rebuilt from their difficulties)."""
        for key in ("dataset_size", "seed"):
            if state[key] != getattr(self, key):
                raise ValueError(f"data_loader: the checkpoint's curriculum sampler has {key}={state[key]}; this one "
                                 f"has {key}={getattr(self, key)}, so its clusters and draws would differ. Resume with the "
                                 f"same dataset and data_efficiency.seed.")
        self.step, self.passes = int(state["step"]), int(state["passes"])
        self.bands, self._clusters, self._orders, self.cursors = [], [], [], []
        for band in state["bands"]:
            self._add_cluster(dict(band))
        if len(self._clusters) != len(state["bands"]):
            raise ValueError("data_loader: the checkpoint's curriculum clusters cannot be rebuilt from this metric "
                             "index (it admits other samples); resume with the index the run was started with.")
        self.cursors = [int(c) for c in state["cursors"]]
        self.current_difficulties = dict(state["current_difficulties"])
