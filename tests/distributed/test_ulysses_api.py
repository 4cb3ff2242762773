"""DeepSpeed's Ulysses surface on two gloo ranks, below the Trainer: `parallel_state_sp` and the
`deepspeed.utils.groups` getters, `UlyssesSPAttentionHF` built directly around transformers' SDPA (against SDPA on
the whole sequence, values and gradients), the adapter's checks, and the attention calls Ulysses refuses."""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness import run_distributed


def _surface() -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    import deepspeed
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from deepspeed.utils import groups
    from shardwise.sequence_parallel import SequenceParallelError

    deepspeed.init_distributed()
    out: dict[str, Any] = {"before": groups._get_sequence_parallel_world_size()}
    mpu.initialize_sequence_parallel(2)
    out["getters"] = [mpu.get_sequence_parallel_world_size(), mpu.get_sequence_parallel_rank(),
                      mpu.get_sequence_data_parallel_world_size(), mpu.get_sequence_data_parallel_rank(),
                      mpu.get_model_parallel_world_size(), groups._get_sequence_parallel_world_size(),
                      groups._get_sequence_parallel_rank(), groups._get_sequence_data_parallel_world_size(),
                      groups._get_sequence_data_parallel_rank()]
    out["same_group"] = groups._get_sequence_parallel_group() is mpu.get_sequence_parallel_group()
    out["data_group_is_world"] = mpu.get_sequence_data_parallel_group() is dist.group.WORLD

    # attention: 4 query heads, 1 key/value head (replicated to 2), 8 tokens of which this rank holds 4
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 8, 8, generator=gen, requires_grad=True) for h in (4, 1, 1))
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups, module.training = True, 4, True
    full, _ = sdpa_attention_forward(module, q, k, v, None)
    full.square().sum().backward()
    local = [t.detach()[:, :, rank * 4:(rank + 1) * 4].clone().requires_grad_() for t in (q, k, v)]
    ulysses = UlyssesSPAttentionHF(sdpa_attention_forward, process_group=mpu.get_sequence_parallel_group())
    mine, _ = ulysses(module, *local, None, position_ids=torch.arange(rank * 4, rank * 4 + 4).unsqueeze(0))
    mine.square().sum().backward()
    out["attention"] = (mine - full[:, rank * 4:(rank + 1) * 4]).abs().max().item()
    grads = [t.grad[:, :, rank * 4:(rank + 1) * 4] for t in (q, k, v)]
    # the ranks' losses sum to the whole one, and the exchanges' backward routes every rank's share to the tokens'
    # owner, so each local gradient is the whole loss's on this rank's tokens
    out["grads"] = max((t.grad - g).abs().max().item() for t, g in zip(local, grads))
    out["groups_restored"] = module.num_key_value_groups == 4

    def refused(call) -> str:
        try:
            call()
        except (SequenceParallelError, ValueError) as e:
            return str(e)
        return "accepted"

    out["kv_cache"] = refused(lambda: ulysses(module, local[0], torch.zeros(1, 1, 6, 8), torch.zeros(1, 1, 6, 8), None))
    module.is_causal = False
    out["bidirectional"] = refused(lambda: ulysses(module, *local, None))
    module.is_causal = True
    out["window"] = refused(lambda: ulysses(module, *local, None, sliding_window=4))
    out["adapter_rank"] = refused(lambda: UlyssesSPDataLoaderAdapter([], sp_rank=1 - rank, sp_group=mpu.get_sequence_parallel_group(),
                                                                    sp_world_size=2, device="cpu"))
    adapter = UlyssesSPDataLoaderAdapter([], sp_rank=rank, sp_group=mpu.get_sequence_parallel_group(), sp_world_size=2,
                                         device="cpu")
    ids = torch.arange(8).unsqueeze(0)
    batch = {"input_ids": ids, "position_ids": ids.clone(), "labels": ids.clone(), "source": f"rank{rank}"}
    out["non_tensors"] = [b["source"] for b in adapter.shard(batch)]
    out["not_a_dict"] = refused(lambda: adapter.shard([ids]))
    rows = 1 + rank  # the ranks' batches hold different numbers of samples
    out["uneven"] = refused(lambda: adapter.shard({"input_ids": ids.repeat(rows, 1), "position_ids": ids.repeat(rows, 1)}))
    return out


def test_deepspeed_s_ulysses_surface_on_two_ranks():
    for rank, out in enumerate(run_distributed(_surface, 2)):
        assert out["before"] == 1
        assert out["getters"] == [2, rank, 2, rank, 2, 2, rank, 2, rank]
        assert out["same_group"] and out["data_group_is_world"]
        assert out["attention"] < 1e-5 and out["grads"] < 1e-5 and out["groups_restored"]
        assert "a key/value cache" in out["kv_cache"]
        assert "bidirectional attention" in out["bidirectional"]
        assert "sliding-window attention" in out["window"]
        assert "differ from the group's" in out["adapter_rank"]
        assert out["non_tensors"] == ["rank0", "rank1"]
        assert "must be a dict with input_ids" in out["not_a_dict"]
        assert "must hold the same number" in out["uneven"]


@pytest.mark.parametrize("size", [3])
def test_a_size_that_does_not_divide_the_world_is_refused(size):
    def build() -> str:
        import deepspeed
        import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu

        deepspeed.init_distributed()
        try:
            mpu.initialize_sequence_parallel(size)
        except ValueError as e:
            return str(e)
        return "accepted"

    for message in run_distributed(build, 2):
        assert "must divide the world size (2)" in message
