"""AutoTP ranks that built the model with different seeds (a common script bug) train rank 0's model.

GPT-2 at autotp_size 2: its position embeddings and norms stay whole (replicated) and its fused q/k/v is split
block by block; rank 1 builds it from another seed, so before `initialize` its replicated weights and the
source of its shards differ from rank 0's. As DeepSpeed does, every tensor-parallel rank starts from its group's
first rank's weights: the replicated parameters agree, and the run equals the single-process oracle built from
rank 0's seed. The rank whose copy differed says so.
"""

from __future__ import annotations

import logging
import os

import torch

from tests import tensor_parallel_models as tp_models
from tests.harness import run_distributed

KIND = "gpt2"


def _different_seeds() -> dict:
    import torch.distributed as dist

    import shardwise

    model = tp_models.build(KIND)  # torch.manual_seed(0): the oracle's model
    if int(os.environ["RANK"]):
        torch.manual_seed(1)  # the script's bug: this rank seeds differently
        model = type(model)(model.config)
    whole = {n: p.detach().clone() for n, p in model.named_parameters()}
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("shardwise.tensor_parallel").addHandler(handler)
    engine, *_ = shardwise.initialize(model=model, config=tp_models.config(2, 1))
    replicated = {n: p.detach().clone() for n, p in engine.module.named_parameters() if n not in engine.tensor_shards}
    peers: list = [None, None]
    dist.all_gather_object(peers, (whole, replicated))
    result = tp_models.train(engine)
    result["params"] = tp_models.whole_params(engine)
    (whole0, replicated0), (whole1, replicated1) = peers
    result["built_apart"] = max((whole0[n] - whole1[n]).abs().max().item() for n in replicated0)
    result["replicated_apart"] = max((replicated0[n] - replicated1[n]).abs().max().item() for n in replicated0)
    result["replicated"] = sorted(replicated0)
    result["said"] = said
    return result


def test_ranks_seeded_differently_train_rank_0s_model() -> None:
    oracle = tp_models.oracle(KIND)  # first: the ranks fork with transformers' model modules imported
    rank0, rank1 = run_distributed(_different_seeds, 2, timeout=120)
    assert "transformer.wpe.weight" in rank0["replicated"]
    assert rank0["built_apart"] > 0.05  # the premise: the ranks' models differed where they stay whole
    assert rank0["replicated_apart"] == rank1["replicated_apart"] == 0.0
    for got in (rank0, rank1):
        tp_models.assert_matches(got, oracle, label="rank 1 seeded differently")
    assert rank0["said"] == []
    (warning,) = [m for m in rank1["said"] if "built a different model" in m]
    assert "tensor-parallel rank 1 built a different model from rank 0" in warning
    assert "rank 0's weights" in warning and "transformer.wpe.weight" in warning
