"""Sequence parallelism on a Hugging Face LLaMA (`tensor_parallel.sequence_parallel`) against the single-process
model: losses and final weights, tied and untied embeddings, with ZeRO over the data-parallel ranks."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests import tensor_parallel_models as tp_models
from tests.harness import run_distributed
from tests.tensor_parallel_models import VOCAB


def _model(tied: bool) -> torch.nn.Module:
    return tp_models.build("llama", tie=tied)


@pytest.mark.parametrize("tied, world, stage", [(True, 2, 0), (False, 2, 1), (True, 4, 2)])
def test_sequence_parallel_llama_matches_one_process(tied, world, stage):
    results = run_distributed(tp_models.run_case, world, "llama", tied, 2, stage,
                              tensor_parallel={"sequence_parallel": True})
    want = tp_models.oracle("llama", tied)
    for got in results:
        tp_models.assert_matches(got, want, label=f"tied={tied} stage={stage}")


def _odd_sequence() -> None:
    import shardwise

    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "tensor_parallel": {"autotp_size": 2, "sequence_parallel": True}}
    engine, *_ = shardwise.initialize(model=_model(True), config=config)
    ids = torch.zeros(1, 7, dtype=torch.long)
    engine(input_ids=ids, labels=ids)


def test_a_sequence_that_does_not_split_evenly_is_refused():
    with pytest.raises(AssertionError) as info:
        run_distributed(_odd_sequence, 2)
    assert ("sequence parallelism: a sequence of 7 tokens cannot be split over 2 tensor-parallel ranks; pad the "
            "sequence length to a multiple of 2.") in str(info.value)


def _gpt2_sequence_parallel() -> None:
    import shardwise

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4))
    shardwise.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                                              "tensor_parallel": {"autotp_size": 2, "sequence_parallel": True}})


def test_sequence_parallel_is_refused_where_no_plan_has_it():
    with pytest.raises(AssertionError) as info:
        run_distributed(_gpt2_sequence_parallel, 2)
    assert ("tensor_parallel.sequence_parallel: built for llama, qwen2, qwen3, mistral models; got model type 'gpt2'. "
            "Set it to false.") in str(info.value)
