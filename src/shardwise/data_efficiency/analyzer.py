"""DataAnalyzer: computes per-sample difficulty metrics over a dataset and writes the index the curriculum
sampler reads (format: `index.py`).

Map (`run_map`): worker w of n takes its contiguous share of the dataset (`np.array_split`'s), reads it in
batches of `batch_size` through a DataLoader, and streams each metric's values into its part file
`<save_path>/<metric>/parts/worker<w>.npy` (a memory-mapped .npy, so the dataset is never held). A part
is written under a temporary name and renamed when complete; its `worker<w>.json` is written last and is
what marks it finished, so a killed worker leaves no part that reduce would take for a whole one.
Reduce (`run_reduce`): checks every worker's part is there and was made for a dataset of this length,
then merges them into the index. `run_map_reduce` does both, the map in `num_workers` processes.

Metric types (DeepSpeed's): `single_value_per_sample` (the function returns one value per sample of the
batch: a length, a rarity) and `accumulate_value_over_samples` (the function returns an array that is
summed over all batches: token counts, from which rarity is defined; see `metrics.py`).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset

from .index import (FORMAT, INDEX_TO_METRIC, INDEX_TO_SAMPLE, MANIFEST, METRIC_VALUE, SAMPLE_TO_METRIC,
                    MetricIndexError, save_array_atomic, write_json_atomic)

METRIC_TYPES = ("single_value_per_sample", "accumulate_value_over_samples")
MetricFunction = Callable[[Any], "torch.Tensor | np.ndarray"]


class DataAnalyzer:
    """Writes `<save_path>/<metric>/` for each metric; see the module docstring."""

    def __init__(self, dataset: Dataset, metric_names: Sequence[str], metric_functions: Sequence[MetricFunction],
                 metric_types: Sequence[str], save_path: str | os.PathLike[str], num_workers: int = 1,
                 worker_id: int = 0, batch_size: int = 64, collate_fn: Callable[[list[Any]], Any] | None = None,
                 metric_dtypes: Sequence[Any] | None = None):
        if not (len(metric_names) == len(metric_functions) == len(metric_types)):
            raise ValueError(f"metric_names, metric_functions, metric_types: one entry per metric is required; got "
                             f"{len(metric_names)}, {len(metric_functions)}, {len(metric_types)} entries.")
        bad = [t for t in metric_types if t not in METRIC_TYPES]
        if bad:
            raise ValueError(f"metric_types: each must be one of {METRIC_TYPES}; got {bad}.")
        if num_workers < 1 or not 0 <= worker_id < num_workers:
            raise ValueError(f"worker_id: must be in [0, num_workers={num_workers}); got {worker_id}.")
        if batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1; got {batch_size}.")
        self.dataset, self.size = dataset, len(dataset)  # type: ignore[arg-type]
        self.metric_names, self.metric_functions = list(metric_names), list(metric_functions)
        self.metric_types = list(metric_types)
        self.metric_dtypes = list(metric_dtypes) if metric_dtypes else [None] * len(metric_names)
        self.save_path, self.num_workers, self.worker_id = Path(save_path), num_workers, worker_id
        self.batch_size, self.collate_fn = batch_size, collate_fn

    def share(self, worker_id: int) -> tuple[int, int]:
        """The [start, end) sample range worker `worker_id` maps."""
        base, extra = divmod(self.size, self.num_workers)
        start = worker_id * base + min(worker_id, extra)
        return start, start + base + (worker_id < extra)

    # --- map -----------------------------------------------------------------------------------
    def run_map(self) -> None:
        start, end = self.share(self.worker_id)
        parts = [_Part(self._part_path(name), typ, dtype, start, end, self.size)
                 for name, typ, dtype in zip(self.metric_names, self.metric_types, self.metric_dtypes)]
        for offset, batch in self._batches(start, end):
            rows = min(self.batch_size, end - offset)
            for name, fn, part in zip(self.metric_names, self.metric_functions, parts):
                part.add(offset, _as_numpy(fn(batch), name), rows, name)
        for part in parts:
            part.close()

    def _batches(self, start: int, end: int) -> Iterator[tuple[int, Any]]:
        loader = DataLoader(Subset(self.dataset, range(start, end)), batch_size=self.batch_size, shuffle=False,
                            collate_fn=self.collate_fn)
        for i, batch in enumerate(loader):
            yield start + i * self.batch_size, batch

    def _part_path(self, metric: str, worker_id: int | None = None) -> Path:
        worker = self.worker_id if worker_id is None else worker_id
        return self.save_path / metric / "parts" / f"worker{worker}"

    # --- reduce --------------------------------------------------------------------------------
    def run_reduce(self) -> None:
        for name, typ in zip(self.metric_names, self.metric_types):
            infos = [self._part_info(name, w) for w in range(self.num_workers)]
            directory = self.save_path / name
            if typ == "single_value_per_sample":
                _merge_single(directory, [self._part_path(name, w) for w in range(self.num_workers)], self.size)
            else:
                total = sum(np.load(f"{self._part_path(name, w)}.npy") for w in range(self.num_workers))
                save_array_atomic(directory / METRIC_VALUE, np.asarray(total))
            write_json_atomic(directory / MANIFEST, {"format": FORMAT, "version": 1, "metric": name,
                                                     "metric_type": typ, "dtype": infos[0]["dtype"],
                                                     "num_samples": self.size})

    def _part_info(self, metric: str, worker_id: int) -> dict[str, Any]:
        path = self._part_path(metric, worker_id)
        marker = Path(f"{path}.json")
        if not marker.is_file():
            raise MetricIndexError(f"DataAnalyzer.run_reduce: metric {metric!r}: the part of map worker {worker_id} "
                                   f"of {self.num_workers} is missing or unfinished ({marker}); run run_map() with "
                                   f"worker_id={worker_id} (and num_workers={self.num_workers}) first.")
        info = json.loads(marker.read_text())
        start, end = self.share(worker_id)
        if info["dataset_size"] != self.size or (info["start"], info["end"]) != (start, end):
            raise MetricIndexError(f"DataAnalyzer.run_reduce: metric {metric!r}: map worker {worker_id}'s part covers "
                                   f"samples [{info['start']}, {info['end']}) of a dataset of {info['dataset_size']}; "
                                   f"this dataset of {self.size} split {self.num_workers} ways gives [{start}, "
                                   f"{end}). Re-run run_map() for worker {worker_id} on this dataset.")
        return info

    def run_map_reduce(self) -> None:
        """The map of every worker in `num_workers` processes on this machine, then the reduce."""
        if self.num_workers == 1:
            self.run_map()
        else:
            _map_in_processes(self)
        self.run_reduce()


class _Part:
    """One worker's result for one metric, streamed into a memory-mapped .npy under a temporary name."""

    def __init__(self, path: Path, metric_type: str, dtype: Any, start: int, end: int, dataset_size: int):
        path.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{path}.json").unlink(missing_ok=True)  # unfinished until the marker is written again
        self.path, self.metric_type, self.start, self.end, self.size = path, metric_type, start, end, dataset_size
        self.dtype = np.dtype(dtype) if dtype is not None else None
        self.values: np.ndarray | None = None
        self.written = 0

    def add(self, offset: int, values: np.ndarray, rows: int, metric: str) -> None:
        if self.metric_type == "accumulate_value_over_samples":
            self.values = values.copy() if self.values is None else self.values + values
            return
        values = values.reshape(-1)
        if len(values) != rows:
            raise ValueError(f"metric_functions[{metric!r}]: a single_value_per_sample metric must return one value "
                             f"per sample of the batch ({rows}); got {len(values)} values.")
        if self.values is None:
            self.dtype = self.dtype or values.dtype
            self.values = np.lib.format.open_memmap(f"{self.path}.npy.tmp", mode="w+", dtype=self.dtype,
                                                    shape=(self.end - self.start,))
        self.values[offset - self.start: offset - self.start + rows] = values
        self.written += rows

    def close(self) -> None:
        if self.metric_type == "single_value_per_sample":
            if self.values is None:  # an empty share
                self.values = np.lib.format.open_memmap(f"{self.path}.npy.tmp", mode="w+",
                                                        dtype=self.dtype or np.int64, shape=(0,))
            self.values.flush()  # type: ignore[union-attr]
            self.dtype = self.values.dtype
            del self.values
            os.replace(f"{self.path}.npy.tmp", f"{self.path}.npy")
        else:
            values = self.values if self.values is not None else np.zeros(0, dtype=self.dtype or np.int64)
            self.dtype = values.dtype
            save_array_atomic(Path(f"{self.path}.npy"), values)
        write_json_atomic(Path(f"{self.path}.json"), {"start": self.start, "end": self.end, "dataset_size": self.size,
                                                     "metric_type": self.metric_type, "dtype": str(self.dtype)})


def _as_numpy(values: Any, metric: str) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().numpy()
    if isinstance(values, np.ndarray):
        return values
    raise TypeError(f"metric_functions[{metric!r}]: must return a torch.Tensor or numpy array; got "
                    f"{type(values).__name__}.")


def _merge_single(directory: Path, parts: list[Path], size: int) -> None:
    """sample_to_metric from the parts in order, then the samples sorted by metric (ties by sample id)."""
    arrays = [np.load(f"{p}.npy", mmap_mode="r") for p in parts]
    dtype = np.result_type(*arrays) if arrays else np.int64
    tmp = directory / (SAMPLE_TO_METRIC + ".tmp")
    merged = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(size,))
    offset = 0
    for a in arrays:
        merged[offset: offset + len(a)] = a
        offset += len(a)
    merged.flush()
    order = np.argsort(merged, kind="stable")
    save_array_atomic(directory / INDEX_TO_SAMPLE, order.astype(np.int64))
    save_array_atomic(directory / INDEX_TO_METRIC, np.asarray(merged[order]))
    del merged
    os.replace(tmp, directory / SAMPLE_TO_METRIC)


def _run_worker(analyzer: DataAnalyzer, worker_id: int) -> None:
    analyzer.worker_id = worker_id
    analyzer.run_map()


def _map_in_processes(analyzer: DataAnalyzer) -> None:
    ctx = mp.get_context("fork")  # the dataset and metric functions need not be picklable
    procs = [ctx.Process(target=_run_worker, args=(analyzer, w)) for w in range(analyzer.num_workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failed = [w for w, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        raise RuntimeError(f"DataAnalyzer.run_map_reduce: map workers {failed} of {analyzer.num_workers} failed (their "
                           "tracebacks are above); fix the cause and run again (finished parts are rewritten).")
