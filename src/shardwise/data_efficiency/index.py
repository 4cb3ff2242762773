"""The metric index on disk, as `DataAnalyzer` writes it and the curriculum sampler reads it.

One directory per metric, `<save_path>/<metric>/`:
- `manifest.json`: {"format": "shardwise-metric-index", "version": 1, "metric", "metric_type", "dtype",
  "num_samples"} (the dataset fingerprint is its length);
- `single_value_per_sample`: `sample_to_metric.npy` (metric of sample i at row i), `index_to_sample.npy`
  (sample ids sorted by metric value, ties by sample id) and `index_to_metric.npy` (the metric values in
  that order, so ascending). A value threshold is a `searchsorted` on index_to_metric, a percentile a count;
  both admit a prefix of index_to_sample;
- `accumulate_value_over_samples`: `metric_value.npy` (the sum over every sample, e.g. token counts).
Arrays are plain `.npy` files read through `np.load(mmap_mode="r")`: nothing is read until used, and the
files open with any numpy. Every file is written to a temporary name and renamed when complete.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "shardwise-metric-index"
MANIFEST = "manifest.json"
SAMPLE_TO_METRIC = "sample_to_metric.npy"
INDEX_TO_SAMPLE = "index_to_sample.npy"
INDEX_TO_METRIC = "index_to_metric.npy"
METRIC_VALUE = "metric_value.npy"


class MetricIndexError(ValueError):
    """A metric index that is missing, incomplete or does not match the dataset."""


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def save_array_atomic(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


def metric_dir(path: str | os.PathLike[str]) -> Path:
    """The metric's directory from a config path: the directory itself or one of its files."""
    p = Path(path)
    return p.parent if p.suffix == ".npy" else p


@dataclass(frozen=True)
class MetricIndex:
    """A read-only view of one `single_value_per_sample` metric's index."""

    name: str
    num_samples: int
    sample_to_metric: np.ndarray
    index_to_sample: np.ndarray
    index_to_metric: np.ndarray

    @classmethod
    def open(cls, metric: str, path: str | os.PathLike[str], dataset_size: int | None = None) -> MetricIndex:
        """Open the index at `path` (its directory or any of its .npy files) for `metric`; refuse loudly if it is
        missing or describes a dataset of another size."""
        directory = metric_dir(path)
        manifest_path = directory / MANIFEST
        hint = ("Write it with shardwise.data_efficiency.DataAnalyzer(dataset, ...).run_map_reduce() and point "
                "index_to_sample_path / index_to_metric_path at the metric's directory.")
        if not manifest_path.is_file():
            raise MetricIndexError(f"curriculum_metrics.{metric}: no metric index at {str(path)!r} ({manifest_path} is "
                              f"missing). {hint}")
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("format") != FORMAT or manifest.get("metric_type") != "single_value_per_sample":
            raise MetricIndexError(f"curriculum_metrics.{metric}: {manifest_path} is not a single_value_per_sample "
                              f"metric index; got {manifest}. {hint}")
        size = int(manifest["num_samples"])
        if dataset_size is not None and size != dataset_size:
            raise MetricIndexError(f"curriculum_metrics.{metric}: the index at {str(directory)!r} was built for "
                              f"{size} samples; the dataset has {dataset_size}. Re-run DataAnalyzer on this dataset.")
        arrays = [np.load(directory / f, mmap_mode="r") for f in (SAMPLE_TO_METRIC, INDEX_TO_SAMPLE, INDEX_TO_METRIC)]
        if any(len(a) != size for a in arrays):
            raise MetricIndexError(f"curriculum_metrics.{metric}: the index files in {str(directory)!r} do not all hold "
                              f"{size} rows (an interrupted write?). {hint}")
        return cls(str(manifest["metric"]), size, *arrays)

    def admitted_by_value(self, threshold: float) -> np.ndarray:
        """Sample ids whose metric is <= `threshold`."""
        return np.asarray(self.index_to_sample[: int(np.searchsorted(self.index_to_metric, threshold, "right"))])

    def admitted_by_percentile(self, percentile: float, max_percentile: float) -> np.ndarray:
        """The easiest `percentile / max_percentile` share of the samples (all of them at the maximum)."""
        count = self.num_samples if percentile >= max_percentile else int(self.num_samples * percentile // max_percentile)
        return np.asarray(self.index_to_sample[: max(count, 0)])


def open_accumulated(path: str | os.PathLike[str]) -> np.ndarray:
    """An `accumulate_value_over_samples` metric's result (e.g. token counts) from its directory."""
    directory = metric_dir(path)
    if not (directory / METRIC_VALUE).is_file():
        raise MetricIndexError(f"{str(path)!r}: no accumulated metric ({METRIC_VALUE} missing); run DataAnalyzer's "
                          "run_reduce() first.")
    return np.load(directory / METRIC_VALUE)
