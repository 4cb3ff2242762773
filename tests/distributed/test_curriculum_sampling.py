"""The data-sampling curriculum through `initialize(training_data=...)` at world 2: training equals a
single-process oracle drawing the same global batches, and a run resumed at another layout (world 2 with
another micro-batch, world 1) reads the global batches the uninterrupted run reads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from shardwise.config import parse_config
from shardwise.data_efficiency import CurriculumSampler, DataAnalyzer, MetricIndex, MetricIndexError
from tests.harness import RankFailure, run_distributed
from tests.parity import SEQ, VOCAB, ds_config, make_model, oracle_step, param_groups

N, BATCH, STEPS = 30, 8, 6
METRIC = np.array([(7 * i) % 10 + 1 for i in range(N)])


def dataset() -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(0, VOCAB, (SEQ,), generator=g), torch.randint(0, VOCAB, (SEQ,), generator=g), i)
            for i in range(N)]


def config(index: str, micro: int, accum: int) -> dict:
    metric = {"index_to_sample_path": f"{index}/index_to_sample.npy", "index_to_metric_path":
              f"{index}/index_to_metric.npy", "difficulty_type": "value", "min_difficulty": 3,
              "max_difficulty": 10, "schedule_type": "fixed_linear",
              "schedule_config": {"total_curriculum_step": 5, "difficulty_step": 1}}
    return ds_config(micro, accum, data_efficiency={"enabled": True, "seed": 7, "data_sampling": {
        "enabled": True, "num_epochs": 10, "curriculum_learning": {"enabled": True,
                                                                 "curriculum_metrics": {"len": metric}}}})


@pytest.fixture
def index(tmp_path: Path) -> str:
    DataAnalyzer([{"m": torch.tensor(int(v))} for v in METRIC], ["len"], [lambda b: b["m"]],
                 ["single_value_per_sample"], tmp_path / "index").run_map_reduce()
    return str(tmp_path / "index" / "len")


def oracle(index: str, steps: int) -> tuple[list[list[int]], list[float]]:
    cfg = parse_config(config(index, 2, 2), dp_size=2)
    curriculum = cfg.data_efficiency.curriculum
    sampler = CurriculumSampler(curriculum, {"len": MetricIndex.open("len", index, N)}, N, BATCH, 7)
    data = dataset()
    model = make_model()
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2, betas=(0.9, 0.99), eps=1e-8)
    batches, losses = [], []
    for _ in range(steps):
        ids = sampler.next_global_batch().tolist()
        assert (METRIC[ids] <= sampler.current_difficulties["len"]).all()
        tokens, labels = torch.stack([data[i][0] for i in ids]), torch.stack([data[i][1] for i in ids])
        batches.append(sorted(ids))
        losses.append(oracle_step(model, opt, model(tokens, labels), 0.0))
    return batches, losses


def _train(index: str, root: str, micro: int, accum: int, start: int, steps: int, save: bool) -> dict:
    import torch.distributed as dist

    import shardwise

    model = make_model()
    engine, _, loader, _ = shardwise.initialize(model=model, model_parameters=param_groups(model),
                                                training_data=dataset(), config=config(index, micro, accum))
    seen: list[list[int]] = []
    engine.set_data_post_process_func(lambda batch, state: (seen.append(batch[2].tolist()), batch[:2])[1])
    if start:
        engine.load_checkpoint(root)
    it, ids, losses = iter(loader), [], []
    for _ in range(steps):
        total = torch.zeros(())
        for _ in range(accum):
            loss = engine(*next(it))
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total)
        losses.append(total.item() / (accum * dist.get_world_size()))
        ids.append(sum(seen[-accum:], []))
    if save:
        engine.save_checkpoint(root)
    return {"ids": ids, "losses": losses}


def merged(results: list[dict]) -> list[list[int]]:
    return [sorted(sum((r["ids"][k] for r in results), [])) for k in range(len(results[0]["ids"]))]


def test_training_equals_an_oracle_drawing_the_same_batches(index: str, tmp_path: Path) -> None:
    batches, losses = oracle(index, STEPS)
    results = run_distributed(_train, 2, index, str(tmp_path), 2, 2, 0, STEPS, False)
    assert merged(results) == batches
    np.testing.assert_allclose(results[0]["losses"], losses, rtol=1e-5)


@pytest.mark.parametrize("world, micro, accum", [(2, 1, 4), (1, 4, 2)])
def test_resume_at_another_layout_reads_the_same_global_batches(index: str, tmp_path: Path, world: int,
                                                                  micro: int, accum: int) -> None:
    batches, losses = oracle(index, STEPS)
    root = str(tmp_path / "ckpt")
    first = run_distributed(_train, 2, index, root, 2, 2, 0, 3, True)
    rest = run_distributed(_train, world, index, root, micro, accum, 3, STEPS - 3, False)
    assert merged(first) + merged(rest) == batches
    np.testing.assert_allclose(first[0]["losses"] + rest[0]["losses"], losses, rtol=1e-5)


def _build(cfg: dict) -> None:
    import shardwise

    model = make_model()
    shardwise.initialize(model=model, training_data=dataset(), config=cfg)


def test_a_missing_index_is_named(tmp_path: Path) -> None:
    with pytest.raises(RankFailure, match=r"curriculum_metrics.len: no metric index at .*nowhere. \(.*manifest.json is missing\)"
                       r".*DataAnalyzer"):
        run_distributed(_build, 1, config(str(tmp_path / "nowhere"), 4, 2))
    with pytest.raises(MetricIndexError):
        MetricIndex.open("len", tmp_path / "nowhere")
