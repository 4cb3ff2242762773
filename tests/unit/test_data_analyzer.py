"""DataAnalyzer: map in workers (each streaming its share to a part file), reduce into the index, and the
built-in metrics, against the metrics computed directly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from shardwise.data_efficiency import DataAnalyzer, MetricIndex, MetricIndexError, metrics
from shardwise.data_efficiency.index import open_accumulated

VOCAB, SEQ, N = 11, 7, 23


def dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(N):
        length = int(torch.randint(1, SEQ + 1, (1,), generator=g))
        ids = torch.randint(1, VOCAB, (SEQ,), generator=g)
        ids[length:] = 0
        rows.append({"input_ids": ids, "attention_mask": (torch.arange(SEQ) < length).long()})
    return rows


def analyzer(path: Path, fns: list, names: list[str], types: list[str], **kw: object) -> DataAnalyzer:
    return DataAnalyzer(dataset(), metric_names=names, metric_functions=fns, metric_types=types, save_path=path,
                        batch_size=4, **kw)


def test_map_in_two_workers_and_reduce_equal_direct_metrics(tmp_path: Path) -> None:
    data = dataset()
    counts = analyzer(tmp_path, [metrics.token_counts(VOCAB)], ["tokens"], ["accumulate_value_over_samples"],
                      num_workers=2)
    counts.run_map_reduce()
    ids = torch.stack([d["input_ids"] for d in data])
    mask = torch.stack([d["attention_mask"] for d in data]).bool()
    expected_counts = torch.bincount(ids[mask], minlength=VOCAB).numpy()
    assert open_accumulated(tmp_path / "tokens").tolist() == expected_counts.tolist()

    rarity = metrics.vocab_rarity(open_accumulated(tmp_path / "tokens"))
    both = analyzer(tmp_path, [metrics.seqlen(), rarity], ["seqlen", "rarity"],
                    ["single_value_per_sample", "single_value_per_sample"], num_workers=2)
    both.run_map_reduce()
    lengths = mask.sum(1).numpy()
    p = np.maximum(expected_counts, 1) / np.maximum(expected_counts, 1).sum()
    expected_rarity = np.array([-np.log(p[i[m]]).sum() for i, m in zip(ids.numpy(), mask.numpy())])
    for name, expected in (("seqlen", lengths), ("rarity", expected_rarity)):
        index = MetricIndex.open(name, tmp_path / name, dataset_size=N)
        np.testing.assert_allclose(index.sample_to_metric, expected, rtol=1e-12)
        order = np.argsort(expected, kind="stable")
        assert index.index_to_sample.tolist() == order.tolist()
        np.testing.assert_allclose(index.index_to_metric, expected[order], rtol=1e-12)
    seqlen = MetricIndex.open("seqlen", tmp_path / "seqlen" / "index_to_sample.npy")
    assert sorted(seqlen.admitted_by_value(3).tolist()) == [i for i in range(N) if lengths[i] <= 3]
    assert seqlen.admitted_by_percentile(50, 100).tolist() == order_of(lengths)[: N // 2]
    assert len(seqlen.admitted_by_percentile(100, 100)) == N


def order_of(values: np.ndarray) -> list[int]:
    return np.argsort(values, kind="stable").tolist()


def test_map_streams_parts_to_disk_in_batches(tmp_path: Path) -> None:
    seen: list[int] = []

    def length(batch: dict) -> torch.Tensor:
        seen.append(len(batch["input_ids"]))
        return batch["attention_mask"].sum(1)

    a = analyzer(tmp_path, [length], ["seqlen"], ["single_value_per_sample"], num_workers=2, worker_id=1)
    a.run_map()
    assert seen == [4, 4, 3]  # worker 1's share is samples [12, 23), read 4 at a time
    part = tmp_path / "seqlen" / "parts"
    assert sorted(p.name for p in part.iterdir()) == ["worker1.json", "worker1.npy"]
    assert json.loads((part / "worker1.json").read_text())["start"] == 12
    assert np.load(part / "worker1.npy").tolist() == [int(d["attention_mask"].sum()) for d in dataset()[12:]]


def test_reduce_refuses_a_missing_part(tmp_path: Path) -> None:
    a = analyzer(tmp_path, [metrics.seqlen()], ["seqlen"], ["single_value_per_sample"], num_workers=2, worker_id=0)
    a.run_map()
    with pytest.raises(MetricIndexError, match=r"DataAnalyzer.run_reduce: metric 'seqlen': the part of map worker 1 "
                       r"of 2 is missing or unfinished .*worker1.json\); run run_map\(\) with worker_id=1"):
        a.run_reduce()


def test_reduce_refuses_a_part_of_another_dataset(tmp_path: Path) -> None:
    for w in range(2):
        analyzer(tmp_path, [metrics.seqlen()], ["seqlen"], ["single_value_per_sample"], num_workers=2,
                 worker_id=w).run_map()
    smaller = DataAnalyzer(dataset()[:20], ["seqlen"], [metrics.seqlen()], ["single_value_per_sample"], tmp_path,
                           num_workers=2)
    with pytest.raises(MetricIndexError, match=r"map worker 0's part covers samples \[0, 12\) of a dataset of 23; "
                       r"this dataset of 20 split 2 ways gives \[0, 10\)"):
        smaller.run_reduce()


def test_index_refuses_another_dataset_size(tmp_path: Path) -> None:
    analyzer(tmp_path, [metrics.seqlen()], ["seqlen"], ["single_value_per_sample"]).run_map_reduce()
    with pytest.raises(MetricIndexError, match=r"curriculum_metrics.seqlen: the index at .* was built for 23 "
                       r"samples; the dataset has 24. Re-run DataAnalyzer"):
        MetricIndex.open("seqlen", tmp_path / "seqlen", dataset_size=24)
    with pytest.raises(MetricIndexError, match=r"curriculum_metrics.rarity: no metric index at .*DataAnalyzer"):
        MetricIndex.open("rarity", tmp_path / "rarity")


def test_metric_function_errors(tmp_path: Path) -> None:
    a = analyzer(tmp_path, [lambda b: b["input_ids"][:1, 0]], ["bad"], ["single_value_per_sample"])
    with pytest.raises(ValueError, match=r"metric_functions\['bad'\]: a single_value_per_sample metric must return "
                       r"one value per sample of the batch \(4\); got 1 values."):
        a.run_map()
    with pytest.raises(ValueError, match=r"metric_types: each must be one of"):
        analyzer(tmp_path, [metrics.seqlen()], ["x"], ["per_token"])
