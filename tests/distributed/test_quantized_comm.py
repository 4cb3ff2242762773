"""ZeRO++'s quantized collectives (`zero/quantized_comm.py`) and `Collectives.all_to_all` under them, on gloo
ranks, against what each rank can compute alone from every rank's (seeded) input."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from shardwise.distributed import Collectives
from shardwise.distributed.topology import Group
from shardwise.zero.quantize import BlockQuant
from shardwise.zero.quantized_comm import QuantizedReduceScatter, quantized_all_gather
from shardwise.zero.reducers import GradAveraging, ReduceScatterMean
from tests.harness import run_distributed

SLACK = 2e-5  # fp32 rounding inside the codec, in units of a block's scale (tests/unit/test_quantize.py)


def _world() -> tuple[int, int, Group]:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    return rank, world, Group("data", dist.group.WORLD, world, rank)


def _round_trip(quant: BlockQuant, values: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    packed = torch.empty(quant.packed_bytes(values.numel()), dtype=torch.uint8)
    quant.pack(values, packed)
    out = torch.empty(values.numel(), dtype=dtype)
    quant.unpack(packed, values.numel(), out)
    return out


def _half_scales(quant: BlockQuant, values: torch.Tensor) -> torch.Tensor:
    """Each element's bound: its block's absmax / qmax / 2 (with the codec's fp32 slack)."""
    padded = torch.zeros(quant.blocks(values.numel()) * quant.block, dtype=torch.float64)
    padded[: values.numel()] = values.double().abs()
    absmax = padded.view(-1, quant.block).amax(dim=1, keepdim=True).expand(-1, quant.block)
    return (absmax.reshape(-1)[: values.numel()] / quant.qmax) * (0.5 + SLACK)


def _exchange_chunks() -> list[torch.Tensor]:
    rank, world, group = _world()
    comm, m = Collectives(), 5
    results = []
    for dtype in (torch.float32, torch.uint8):  # uint8: the quantized reduce-scatter's payload
        sent = (torch.arange(world * m) + 50 * rank).to(dtype)
        received = torch.full((world * m,), 255, dtype=dtype)
        pending = comm.all_to_all(received, sent, group)
        pending.wait()
        expected = torch.cat([torch.arange(rank * m, (rank + 1) * m) + 50 * k for k in range(world)]).to(dtype)
        assert torch.equal(received, expected), (dtype, received, expected)
        results.append(received)
    assert comm.stats.calls("all_to_all") == 2
    assert comm.stats.ops[("all_to_all", "data")].bytes == world * m * (4 + 1)
    with pytest.raises(ValueError, match="all_to_all: input and output of the same size, a multiple of"):
        comm.all_to_all(torch.empty(world * m), torch.empty(world * m + 1), group)
    # A group of one: a copy, counted too.
    solo_pg = [dist.new_group([k]) for k in range(world)][rank]
    solo = Group("solo", solo_pg, 1, 0)
    copied = torch.zeros(3)
    comm.all_to_all(copied, torch.tensor([1.0, 2.0, 3.0]), solo).wait()
    assert copied.tolist() == [1.0, 2.0, 3.0] and comm.stats.calls("all_to_all", "solo") == 1
    return results


def test_all_to_all_sends_chunk_r_to_rank_r():
    run_distributed(_exchange_chunks, 3)


def _gather(chunk: int, bits: int, block: int) -> list[torch.Tensor]:
    rank, world, group = _world()
    quant = BlockQuant(bits, block)
    shards = [torch.randn(chunk, generator=torch.Generator().manual_seed(k)) * (k + 1) for k in range(world)]
    exact = torch.cat(shards)
    expected = torch.cat([_round_trip(quant, s) for s in shards])
    gathered = []
    for comm in (Collectives(shm=False), Collectives()):  # gloo's per-rank broadcasts, then shared memory
        output = torch.full((world * chunk,), float("nan"))
        handle = quantized_all_gather(comm, output, shards[rank].clone(), group, quant)
        deadline = time.monotonic() + 20
        while not handle.done():
            assert time.monotonic() < deadline, "done() never turned true"
            time.sleep(0.001)
        handle.wait()
        # Bit for bit the concatenated round trips, this rank's own chunk included.
        assert torch.equal(output, expected)
        bound = torch.cat([_half_scales(quant, s) for s in shards])  # blocks start afresh in every shard
        assert ((output.double() - exact.double()).abs() <= bound).all()
        stats = comm.stats.ops[("all_gather", "data")]
        assert stats.calls == 1 and stats.bytes == world * quant.packed_bytes(chunk)
        ideal = bits / 8 + 4 / block  # bytes per element on the wire; fp32 pays 4
        padded = quant.blocks(chunk) * block / chunk  # the tail block travels whole
        assert stats.bytes / (world * chunk * 4) == pytest.approx(ideal * padded / 4, rel=1e-9)
        gathered.append(output)
    # 16-bit weights: the shard and the output in bf16, dequantized straight into bf16.
    output = torch.empty(world * chunk, dtype=torch.bfloat16)
    quantized_all_gather(Collectives(), output, shards[rank].bfloat16(), group, quant).wait()
    assert torch.equal(output, torch.cat([_round_trip(quant, s.bfloat16(), torch.bfloat16) for s in shards]))
    with pytest.raises(ValueError, match=r"quantized_all_gather: a shard of 1/\d of the output \(data group\)"):
        quantized_all_gather(Collectives(), output, torch.empty(chunk + 1), group, quant)
    return gathered


@pytest.mark.parametrize("world, chunk, bits, block", [(2, 1001, 8, 256), (3, 333, 4, 64), (3, 512, 8, 256)])
def test_quantized_all_gather_gives_every_rank_the_same_round_tripped_weights(world, chunk, bits, block):
    per_rank = run_distributed(_gather, world, chunk, bits, block)
    for gathered in per_rank[1:]:
        for mine, theirs in zip(gathered, per_rank[0]):
            assert torch.equal(mine, theirs)


def _bucket(flat: torch.Tensor, chunk: int) -> SimpleNamespace:
    return SimpleNamespace(flat=flat, shard_grad=torch.zeros(chunk))


def _reduce(chunk: int, prescale: bool) -> dict[str, object]:
    rank, world, group = _world()
    quant, averaging = BlockQuant(4, 64), GradAveraging.make(world, prescale, predivide_factor=1.0)
    grads = [torch.randn(world * chunk, generator=torch.Generator().manual_seed(10 + k)) * (k + 1)
             for k in range(world)]
    mine = slice(rank * chunk, (rank + 1) * chunk)
    # What this rank must end with: every rank's scaled chunk `rank`, round-tripped, summed in rank order.
    sent = [g[mine] * averaging.before for g in grads]
    total = _round_trip(quant, sent[0])
    for part in sent[1:]:
        total.add_(_round_trip(quant, part))
    expected = torch.zeros(chunk).add_(total, alpha=averaging.after)

    comm = Collectives()
    reducer = QuantizedReduceScatter(comm, group, averaging, quant)
    bucket = _bucket(grads[rank].clone(), chunk)
    reducer.launch(bucket).finish()
    torch.testing.assert_close(bucket.shard_grad, expected, rtol=1e-6, atol=1e-7)
    # Against the exact mean: each rank's contribution is off by at most half its block's scale.
    exact = _bucket(grads[rank].clone(), chunk)
    ReduceScatterMean(comm, group, averaging, torch.float32, accumulate=True).launch(exact).finish()
    bound = sum(_half_scales(quant, s) for s in sent) * averaging.after + 1e-6
    error = (bucket.shard_grad.double() - exact.shard_grad.double()).abs()
    assert (error <= bound).all() and error.max() > 0
    # Accumulating: a second reduction of the same gradients adds its mean.
    again = SimpleNamespace(flat=grads[rank].clone(), shard_grad=bucket.shard_grad)
    reducer.launch(again).finish()
    torch.testing.assert_close(bucket.shard_grad, expected + expected, rtol=1e-6, atol=1e-7)
    return {
        "shard": bucket.shard_grad, "norm": reducer.global_norm([bucket.shard_grad]),
        "quantized_bytes": comm.stats.ops[("all_to_all", "data")].bytes,
        "exact_bytes": comm.stats.ops[("reduce_scatter", "data")].bytes,
        "calls": comm.stats.calls("all_to_all"),
    }


@pytest.mark.parametrize("world, chunk, prescale", [(2, 1000, False), (3, 333, True)])
def test_quantized_reduce_scatter_gives_each_rank_its_mean(world, chunk, prescale):
    per_rank = run_distributed(_reduce, world, chunk, prescale)
    everything = torch.cat([r["shard"] for r in per_rank])
    for r in per_rank:
        torch.testing.assert_close(r["norm"], everything.norm())
        assert r["calls"] == 2  # one all-to-all per reduction
        # int4 with blocks of 64: 0.5 + 4/64 bytes per element against fp32's 4 (the tail block padded)
        quant = BlockQuant(4, 64)
        assert r["exact_bytes"] == world * chunk * 4
        assert r["quantized_bytes"] == 2 * world * quant.packed_bytes(chunk)
        assert r["quantized_bytes"] / 2 / r["exact_bytes"] == pytest.approx(
            (0.5 + 4 / 64) / 4 * quant.blocks(chunk) * 64 / chunk, rel=1e-9)
