"""The loader `initialize(training_data=...)` builds under tensor parallelism: a tensor group's ranks read the
same micro-batches, data-parallel ranks different ones, and the batch size counts data-parallel ranks only."""

from __future__ import annotations

import torch
import transformers

from tests.harness import run_distributed


def _rank() -> tuple[tuple[int, int], list[list[int]], int]:
    import shardwise

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32))
    data = [torch.full((4,), i) for i in range(16)]
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "seed": 3,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "tensor_parallel": {"autotp_size": 2}}
    engine, _, loader, _ = shardwise.initialize(model=model, config=config, training_data=data)
    seen = [batch[:, 0].tolist() for batch in loader]
    return (engine.topology.data.rank, engine.topology.tensor.rank), seen, engine.train_batch_size()


def test_a_tensor_group_reads_the_same_micro_batches():
    results = run_distributed(_rank, 4)
    by_coords = {coords: seen for coords, seen, _ in results}
    assert [coords for coords, _, _ in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]  # tensor fastest
    assert by_coords[(0, 0)] == by_coords[(0, 1)] and by_coords[(1, 0)] == by_coords[(1, 1)]
    first, second = sum(by_coords[(0, 0)], []), sum(by_coords[(1, 0)], [])
    assert not set(first) & set(second) and sorted(first + second) == list(range(16))
    assert {size for _, _, size in results} == {2 * 2 * 2}  # micro x accumulation x 2 data-parallel ranks
