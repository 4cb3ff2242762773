"""`initialize(mpu=...)`: a Megatron-style mpu whose model splits its own layers (parameters marked
`tensor_model_parallel` / `partition_dim`). When the mpu's groups are shardwise's (pipe x data x tensor, tensor
fastest), the model trains as the single-process oracle does at tp2 x dp2 (clipped: the split parameters' norm
is summed over the tensor-parallel ranks, the whole ones counted once); when they are not, every rank refuses
with the mismatch, before any training collective."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.harness import run_distributed
from tests.parity import oracle_step

DIM, HIDDEN, BATCH, STEPS, LR = 6, 8, 8, 3, 1e-2
CLIP = 0.3
"""Below the oracle's gradient norm at every step here (0.64 to 0.75): clipping acts each step."""


class Whole(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(DIM, HIDDEN), torch.nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.fc2(F.gelu(self.fc1(x))), y)


class MegatronMLP(torch.nn.Module):
    """The same MLP split by its author: fc1 column-parallel, fc2 row-parallel (its bias whole), each split
    parameter marked as Megatron marks it."""

    def __init__(self, link) -> None:
        super().__init__()
        whole, rank, size = Whole(), link.rank, link.size
        self.link = link
        self.fc1_weight = _marked(whole.fc1.weight.chunk(size, 0)[rank], dim=0)
        self.fc1_bias = _marked(whole.fc1.bias.chunk(size, 0)[rank], dim=0)
        self.fc2_weight = _marked(whole.fc2.weight.chunk(size, 1)[rank], dim=1)
        self.fc2_bias = torch.nn.Parameter(whole.fc2.bias.detach().clone())

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from shardwise.tensor_parallel import copy_in, reduce_out

        hidden = F.gelu(F.linear(copy_in(x, self.link), self.fc1_weight, self.fc1_bias))
        return F.mse_loss(reduce_out(F.linear(hidden, self.fc2_weight), self.link) + self.fc2_bias, y)


def _marked(value: torch.Tensor, dim: int) -> torch.nn.Parameter:
    param = torch.nn.Parameter(value.detach().clone())
    param.tensor_model_parallel, param.partition_dim = True, dim
    return param


class Mpu:
    """Megatron's mpu interface over groups built from lists of ranks."""

    def __init__(self, tensor_lists: list[list[int]], data_lists: list[list[int]]):
        import torch.distributed as dist

        self.tensor, self.data = (_own(dist, lists) for lists in (tensor_lists, data_lists))

    def get_model_parallel_group(self):
        return self.tensor

    def get_model_parallel_world_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size(self.tensor)

    def get_model_parallel_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank(self.tensor)

    def get_data_parallel_group(self):
        return self.data


def _own(dist, lists: list[list[int]]):
    """Every rank creates every group (new_group is collective); each keeps its own."""
    groups = [dist.new_group(ranks) for ranks in lists]
    return next(g for g, ranks in zip(groups, lists) if dist.get_rank() in ranks)


def _model(mpu: Mpu) -> MegatronMLP:
    from shardwise.distributed import Collectives, Group
    from shardwise.tensor_parallel import TensorLink

    return MegatronMLP(TensorLink(Collectives(), Group("tensor", mpu.tensor, 2, mpu.get_model_parallel_rank())))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, DIM, generator=g)


def _config() -> dict:
    return {"train_micro_batch_size_per_gpu": BATCH // 2, "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.0}}}


def _rank_run() -> dict:
    import torch.distributed as dist

    import shardwise
    from shardwise.tensor_parallel import TensorParallelError

    shardwise.init_distributed()
    refused = []
    # data-parallel fastest: rank 0's tensor-parallel partner would be rank 2, not shardwise's rank 1; then data
    # groups right on ranks 0 and 2 only ([0, 2]), wrong on ranks 1 and 3 (alone): those two must not go on alone
    for wrong in (Mpu([[0, 2], [1, 3]], [[0, 1], [2, 3]]), Mpu([[0, 1], [2, 3]], [[0, 2], [1], [3]])):
        model = _model(wrong)
        with pytest.raises(TensorParallelError) as info:
            shardwise.initialize(model=model, model_parameters=model.parameters(), config=_config(), mpu=wrong)
        refused.append(str(info.value))

    right = Mpu([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    model = _model(right)
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=_config(), mpu=right)
    dp_rank, losses = dist.get_rank(right.data), []
    for step in range(STEPS):
        x, y = (t[dp_rank * BATCH // 2 : (dp_rank + 1) * BATCH // 2] for t in _batch(step))
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=right.data)
        losses.append(mean.item() / 2)
    return {"refused": refused, "losses": losses, "shards": sorted(engine.tensor_shards),
            "params": {n: p.detach().clone() for n, p in engine.module.named_parameters()}}


def _oracle() -> tuple[list[float], Whole]:
    model = Whole()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
    return [oracle_step(model, opt, model(*_batch(step)), CLIP) for step in range(STEPS)], model


def test_megatron_mpu_matching_trains_like_the_oracle_and_one_that_does_not_is_refused():
    results = run_distributed(_rank_run, 4, timeout=180)
    fix = "Build the mpu's groups with adjacent ranks in a tensor group, as Megatron does."
    for rank, r in enumerate(results):
        expected = [rank // 2 * 2 + t for t in (0, 1)]
        assert r["refused"][0] == (
            f"mpu: its tensor-parallel group on rank {rank} must be {expected}, as shardwise lays ranks out (pipe x "
            f"data x tensor, tensor fastest); got {sorted([rank % 2, rank % 2 + 2])}. {fix}")
    assert [r["refused"][1] for r in results[1::2]] == [
        f"mpu: its data-parallel group on rank {rank} must be [1, 3], as shardwise "
        f"lays ranks out (pipe x data x tensor, tensor fastest); got [{rank}]. {fix}" for rank in (1, 3)]
    assert [r["refused"][1] for r in results[::2]] == [(
        "mpu: its groups differ from shardwise's on 2 other rank(s), though not on this one; see those ranks' "
        "errors, and build the mpu's groups with adjacent ranks in a tensor group, as Megatron does.")] * 2
    ref_losses, ref = _oracle()
    for rank, r in enumerate(results):
        assert r["shards"] == ["fc1_bias", "fc1_weight", "fc2_weight"]  # the marked ones, described for checkpoints
        torch.testing.assert_close(r["losses"], ref_losses, rtol=1e-5, atol=0, msg=lambda m: f"rank {rank}: {m}")
    pair = results[:2]  # tensor-parallel ranks 0 and 1 of data replica 0
    whole = {"fc1_weight": (ref.fc1.weight, 0), "fc1_bias": (ref.fc1.bias, 0), "fc2_weight": (ref.fc2.weight, 1)}
    for name, (value, dim) in whole.items():
        torch.testing.assert_close(torch.cat([r["params"][name] for r in pair], dim), value.detach(), rtol=1e-5,
                                   atol=1e-5, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(pair[1]["params"]["fc2_bias"], ref.fc2.bias.detach(), rtol=1e-5, atol=1e-5)

