"""`shardwise serve`'s ranks agree after every batch whether it failed: an error every rank met fails only that
batch, an error on some ranks only stops the server on every rank (they would no longer run the same steps)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from tests.harness import run_distributed
from tests.tiny_llm import write_tiny_llama

pytest.importorskip("transformers")


def _batch_failing_on(folder: Path, failing: list[int]) -> str:
    from shardwise.inference import load_pretrained
    from shardwise.inference.serve import worker
    from shardwise.inference.serve.batching import Batch

    engine = load_pretrained(folder, tensor_parallel={"tp_size": 2}, max_out_tokens=64)

    def generate(engine, batch: Batch):
        if dist.get_rank() in failing:
            raise MemoryError("out of memory on this rank")
        return [[1, 2]]

    worker.generate = generate
    try:
        _, error = worker.generate_together(engine, None)
    except worker.RanksOutOfStep as stopped:
        return f"stopped: {stopped}"
    return f"failed alike: {error!r}" if error is not None else "ok"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"))


def test_a_failure_on_one_rank_stops_every_rank(folder: Path) -> None:
    outcomes = run_distributed(_batch_failing_on, 2, folder, [1])
    assert all(o.startswith("stopped: shardwise serve: a batch failed on some tensor-parallel ranks only") for o in outcomes)
    assert "MemoryError" in outcomes[1] and "rank 0" in outcomes[0]


def test_a_failure_on_every_rank_fails_the_batch_only(folder: Path) -> None:
    assert run_distributed(_batch_failing_on, 2, folder, [0, 1]) == ["failed alike: MemoryError('out of memory on "
                                                                      "this rank')"] * 2
    assert run_distributed(_batch_failing_on, 2, folder, []) == ["ok", "ok"]
