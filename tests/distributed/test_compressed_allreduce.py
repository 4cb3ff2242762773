"""The 1-bit error-feedback all-reduce (`optim/onebit/compressed_allreduce.py`) on gloo ranks, against a
pure-torch re-computation of its two rounds written here from the algorithm its docstring describes."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.distributed import Collectives
from shardwise.distributed.topology import Group
from shardwise.optim.onebit.compressed_allreduce import CompressedAllReduce
from tests.harness import run_distributed

BLOCK = 1024  # the default codec's values per scale


def _inputs(step: int, rank: int, numel: int) -> torch.Tensor:
    """Rank `rank`'s tensor at call `step`: seeded, with magnitudes over six decades and some exact zeros."""
    g = torch.Generator().manual_seed(7919 * step + rank)
    values = torch.randn(numel, generator=g) * torch.logspace(-3, 3, numel)
    values[::97] = 0.0
    return values


def _exchange(numels: list[int], calls: int) -> list[dict]:
    """Per numel: each call's result on this rank, the bytes each call counted, and the final errors."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group, comm = Group("data", dist.group.WORLD, world, rank), Collectives()
    out = []
    for numel in numels:
        allreduce = CompressedAllReduce(comm, group, numel, torch.device("cpu"))
        results, traffic = [], []
        for step in range(calls):
            tensor = _inputs(step, rank, numel)
            comm.stats.reset()
            allreduce(tensor)
            results.append(tensor)
            traffic.append({op: (comm.stats.calls(op), comm.stats.elements(op), comm.stats.ops[(op, "data")].bytes)
                            for op in ("all_to_all", "all_gather", "all_reduce")})
        out.append({"results": results, "traffic": traffic, "worker_error": allreduce.worker_error.clone(),
                    "server_error": allreduce.server_error.clone()})
    return out


def _decompressed(values: torch.Tensor) -> torch.Tensor:
    """What 1 bit per value and one scale per block keep: the sign (zero as +) times the block's mean |x|."""
    blocks = values.view(-1, BLOCK)
    scale = blocks.abs().mean(dim=1, keepdim=True)
    return torch.where(blocks >= 0, scale, -scale).view(-1)


class _Reference:
    """Every rank's two rounds in one process, with every rank's error buffers."""

    def __init__(self, world: int, numel: int):
        unit = world * BLOCK
        self.world, self.numel = world, numel
        self.padded = -(-numel // unit) * unit
        self.chunk = self.padded // world
        self.worker = [torch.zeros(self.padded) for _ in range(world)]
        self.server = [torch.zeros(self.chunk) for _ in range(world)]

    def __call__(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        sent = []
        for k in range(self.world):  # round 1: each rank compresses (its tensor + its worker error) chunk by chunk
            work = self.worker[k].clone()
            work[: self.numel] += inputs[k]
            decoded = torch.cat([_decompressed(c) for c in work.split(self.chunk)])
            self.worker[k] = work - decoded
            sent.append(decoded.split(self.chunk))
        means = []
        for r in range(self.world):  # round 2: rank r averages every rank's chunk r in rank order
            total = sent[0][r].clone()
            for k in range(1, self.world):
                total = total + sent[k][r]
            mean = total / self.world + self.server[r]
            decoded = _decompressed(mean)
            self.server[r] = mean - decoded
            means.append(decoded)
        return torch.cat(means)[: self.numel]


NUMELS = [1, 3000, 4096, 5000]  # 4096: a whole padding unit at world 2 and 4; the others are padded


def _check_against_reference(world: int) -> None:
    calls = 3
    ranks = run_distributed(_exchange, world, NUMELS, calls)
    for i, numel in enumerate(NUMELS):
        reference = _Reference(world, numel)
        for step in range(calls):
            expected = reference([_inputs(step, r, numel) for r in range(world)])
            for r in range(world):
                got = ranks[r][i]["results"][step]
                assert torch.equal(got, ranks[0][i]["results"][step]), f"numel {numel} call {step}: rank {r} differs"
                assert torch.equal(got, expected), (f"numel {numel} call {step}: max diff "
                                                    f"{(got - expected).abs().max()}")
        for r in range(world):
            assert torch.equal(ranks[r][i]["worker_error"], reference.worker[r]), f"numel {numel} rank {r}"
            assert torch.equal(ranks[r][i]["server_error"], reference.server[r]), f"numel {numel} rank {r}"


def test_every_rank_gets_the_bit_identical_two_round_result_world_2():
    _check_against_reference(2)


def test_every_rank_gets_the_bit_identical_two_round_result_world_4():
    _check_against_reference(4)


def test_bytes_per_call_are_the_compressed_rows_of_both_rounds():
    # Per call: one all-to-all and one all-gather, each of `world` rows of (chunk/8 sign bytes + 4 bytes per
    # 1024-value block): padded/8 + 4*padded/1024 bytes, against 4*numel for an fp32 all-reduce.
    ranks = run_distributed(_exchange, 2, [3000, 5000, 20000], 2)
    expected = {3000: 4096 // 8 + 4 * 4, 5000: 6144 // 8 + 4 * 6, 20000: 20480 // 8 + 4 * 20}
    for r in range(2):
        for i, (numel, per_op) in enumerate(expected.items()):
            for call in ranks[r][i]["traffic"]:
                assert call == {"all_to_all": (1, per_op, per_op), "all_gather": (1, per_op, per_op),
                                "all_reduce": (0, 0, 0)}, (numel, call)
    assert 2 * 4 * 20000 / (2 * expected[20000]) > 30  # a ring all-reduce sends fp32 twice: what compression saves


def _constant(rank: int, numel: int) -> torch.Tensor:
    """Magnitudes in [0.5, 1.5) with random signs: a block's mean |x| is near its largest |x|, so the errors
    settle within a few hundred calls. (With Gaussian values a block's few outliers need their errors to
    grow until the block's mean |x| reaches them, ~1000x the gap at 1024 values per scale: the mean
    converges, but over thousands of calls.)"""
    g = torch.Generator().manual_seed(31 + rank)
    return (torch.rand(numel, generator=g) + 0.5) * torch.where(torch.rand(numel, generator=g) < 0.5, -1.0, 1.0)


def _repeat_constant(numel: int, calls: int) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """The sum of `calls` results of averaging this rank's constant tensor, the running means after 1 and 20
    calls, this rank's worker error and every rank's server error (concatenated)."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = Group("data", dist.group.WORLD, world, rank)
    allreduce = CompressedAllReduce(Collectives(), group, numel, torch.device("cpu"))
    total, running = torch.zeros(numel, dtype=torch.float64), []
    for call in range(calls):
        tensor = _constant(rank, numel)
        allreduce(tensor)
        total += tensor.double()
        if call in (0, 19):
            running.append(total / (call + 1))
    server = [torch.empty_like(allreduce.server_error) for _ in range(world)]
    dist.all_gather(server, allreduce.server_error)
    return total, running, allreduce.worker_error.clone(), torch.cat(server)


def test_error_feedback_makes_the_running_mean_converge_to_the_exact_mean():
    numel, calls, world = 3000, 400, 2
    ranks = run_distributed(_repeat_constant, world, numel, calls)
    exact = sum(_constant(r, numel).double() for r in range(world)) / world
    total, (first, twentieth), _, server = ranks[0]

    def relative_rms(mean: torch.Tensor) -> float:
        return float((mean - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt())

    # One call alone is far off, and without error feedback every call would be as far off; with it the
    # running mean closes in (measured 0.73, 0.096, 0.012).
    assert relative_rms(first) > 0.5
    assert relative_rms(twentieth) < 0.15
    assert relative_rms(total / calls) < 0.02
    # Exactly why: what the outputs lack is what the errors still hold (the mean of the ranks' worker errors
    # plus the server errors), up to fp32 rounding of the sums.
    carried = sum(ranks[r][2][:numel].double() for r in range(world)) / world + server[:numel].double()
    torch.testing.assert_close(total + carried, calls * exact, rtol=0, atol=1e-5 * calls)
    assert all(torch.equal(ranks[r][0], total) for r in range(world))


def _single_rank(numel: int) -> tuple[bool, int, float]:
    dist.init_process_group("gloo")
    comm = Collectives()
    allreduce = CompressedAllReduce(comm, Group("data", dist.group.WORLD, 1, 0), numel, torch.device("cpu"))
    tensor = _inputs(0, 0, numel)
    allreduce(tensor)
    calls = sum(s.calls for s in comm.stats.ops.values())
    errors = float(allreduce.worker_error.abs().sum() + allreduce.server_error.abs().sum())
    return torch.equal(tensor, _inputs(0, 0, numel)), calls, errors


def test_a_group_of_one_leaves_the_tensor_exactly_as_it_was():
    assert run_distributed(_single_rank, 1, 3000) == [(True, 0, 0.0)]
