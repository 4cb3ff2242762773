"""Sequence parallelism on a Hugging Face LLaMA (`tensor_parallel.sequence_parallel`) against the single-process
model: losses and final weights, tied and untied embeddings, with ZeRO over the data-parallel ranks."""

from __future__ import annotations

import os

import pytest
import torch
import transformers

from tests.harness import run_distributed
from tests.tensor_parallel_models import VOCAB, build

STEPS, BATCH = 3, 4


def _model(tied: bool) -> torch.nn.Module:
    return build("llama", tie=tied)


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, 12), generator=torch.Generator().manual_seed(step))


def _oracle(tied: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model(tied)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        ids = _batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def _rank(tied: bool, stage: int) -> tuple[list[float], dict[str, torch.Tensor] | None]:
    import torch.distributed as dist

    import shardwise

    dp = int(os.environ["WORLD_SIZE"]) // 2
    config = {"train_micro_batch_size_per_gpu": BATCH // dp, "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.5, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
              "tensor_parallel": {"autotp_size": 2, "sequence_parallel": True}}
    engine, *_ = shardwise.initialize(model=_model(tied), config=config)
    rank, size = engine.topology.data.rank, BATCH // dp
    losses = []
    for step in range(STEPS):
        ids = _batch(step)[rank * size:(rank + 1) * size]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    whole = engine._consolidated_16bit_state_dict()
    return losses, None if whole is None else {k: v.clone() for k, v in whole.items()}


@pytest.mark.parametrize("tied, world, stage", [(True, 2, 0), (False, 2, 1), (True, 4, 2)])
def test_sequence_parallel_llama_matches_one_process(tied, world, stage):
    losses, weights = run_distributed(_rank, world, tied, stage)[0]
    want_losses, want_weights = _oracle(tied)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=0)
    assert weights.keys() == want_weights.keys()
    for name, value in want_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-5, msg=name)


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
