"""Comms-logger figures from `CommStats` (bus-bandwidth formulas, rows per message size) and the memory
breakdown against byte counts, without processes."""

from __future__ import annotations

import types

import pytest
import torch

from shardwise.distributed import CommStats
from shardwise.profiling import bus_factor, comm_rows, memory_breakdown, summary_table
from shardwise.profiling.activations import ActivationTracker
from shardwise.profiling.memory import expected_model_states
from shardwise.protocols import ModelStateTensors


@pytest.mark.parametrize("op, n, factor", [
    ("all_reduce", 2, 1.0), ("all_reduce", 4, 1.5), ("all_reduce", 8, 1.75),
    ("all_gather", 4, 0.75), ("reduce_scatter", 2, 0.5), ("broadcast", 4, 1.0), ("all_reduce", 1, 0.0),
])
def test_bus_bandwidth_factor(op, n, factor):
    assert bus_factor(op, n) == pytest.approx(factor)


def test_rows_per_message_size_with_latency_and_bandwidth():
    stats = CommStats()
    for _ in range(3):
        stats.record("all_reduce", "data", torch.zeros(256), group_size=4)()  # completed at once
    stats.record("all_reduce", "data", torch.zeros(16, dtype=torch.bfloat16), group_size=4)  # never waited
    stats.record("all_gather", "data", torch.zeros(64), group_size=4)()
    rows = comm_rows(stats)
    assert [(r.op, r.message_bytes, r.count, r.waited) for r in rows] == [
        ("all_gather", 256, 1, 1), ("all_reduce", 32, 1, 0), ("all_reduce", 1024, 3, 3)]
    big = rows[2]
    assert big.total_latency_s > 0 and big.avg_latency_s == pytest.approx(big.total_latency_s / 3)
    assert big.algbw_bytes_per_s == pytest.approx(1024 / big.avg_latency_s)
    assert big.busbw_bytes_per_s == pytest.approx(big.algbw_bytes_per_s * 1.5)
    assert rows[1].algbw_bytes_per_s == 0.0  # no latency known yet
    assert [r.op for r in comm_rows(stats, ops=["all_gather"])] == ["all_gather"]
    # The counting API the traffic tests use is unchanged.
    assert stats.calls("all_reduce", "data") == 4 and stats.elements("all_reduce") == 256 * 3 + 16
    table = summary_table(rows)
    assert "all_reduce" in table and "1.00 KiB" in table and "busbw (GB/s)" in table and "5 calls" in table


class WithBuffer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(10, 6)
        self.b = torch.nn.Linear(6, 3, bias=False)
        self.frozen = torch.nn.Linear(3, 3)
        self.frozen.requires_grad_(False)
        self.register_buffer("running", torch.zeros(7, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(self.b(torch.relu(self.a(x)))).sum()


def _fake_strategy():
    module = WithBuffer()
    trainable = [p for p in module.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in trainable)
    grad_flat = torch.zeros(numel + 5)  # a padded bucket; parameters' grads are views into it
    optimizer = torch.optim.AdamW(trainable, lr=0.1)
    module(torch.randn(4, 10)).backward()
    optimizer.step()
    for p in module.parameters():
        p.grad = None
    held = ModelStateTensors(trainable, [module.frozen.weight, module.frozen.bias], [grad_flat], trainable,
                             optimizer_offloaded=False, params_offloaded=False)
    return types.SimpleNamespace(module=module, optimizer=optimizer, model_state_tensors=lambda: held), numel


def test_memory_breakdown_matches_byte_counts():
    strategy, numel = _fake_strategy()
    mem = memory_breakdown(strategy, torch.device("cpu"), stage=0, dp_size=2)
    params = sum(p.numel() * 4 for p in strategy.module.parameters())
    # per-element states only: the 0-d step counters are no model state
    state = sum(t.numel() * t.element_size() for s in strategy.optimizer.state.values() for t in s.values() if t.dim())
    frozen = sum(p.numel() * 4 for p in strategy.module.frozen.parameters())
    assert mem.parameters.host == params - frozen and mem.parameters.device == 0
    assert mem.frozen_parameters.host == frozen and "frozen parameters" in mem.table()
    assert mem.master_weights.total == 0  # fp32: the optimizer updates the module's own parameters
    assert mem.gradients.host == (numel + 5) * 4
    assert mem.optimizer_state.host == state
    assert mem.buffers.host == 7 * 8
    assert mem.device_peak is None and mem.host_peak_rss > 0
    assert mem.expected_model_states == params + numel * 4 + numel * 8
    assert "optimizer state" in mem.table()


def test_zero_formula_per_stage():
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])
    psi, n = 1000, 4
    # bf16 parameters and gradients, fp32 masters: DeepSpeed's 2 + 2 + 12 bytes per parameter.
    stages = [expected_model_states(2 * psi, psi, 2, 4, opt, stage, n) for stage in range(4)]
    assert stages == [16 * psi, 4 * psi + 12 * psi // n, 2 * psi + 14 * psi // n, 2 * psi // n + 14 * psi // n]
    assert expected_model_states(4, 1, 4, 0, torch.optim.Rprop([torch.nn.Parameter(torch.zeros(1))]), 0, 1) is None


def test_activation_tracker_counts_saved_tensors_once_without_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    tracker = ActivationTracker(True)
    x = torch.randn(5, 16)
    with tracker.track(model):
        model(x).sum().backward()
    # Saved: the input x (for the weight grad), the tanh output (for tanh's and the 2nd linear's grads).
    assert tracker.peak == (5 * 16 + 5 * 32) * 4
    off = ActivationTracker(False)  # without memory_breakdown: the first forward that builds a graph only
    with torch.no_grad(), off.track(model):
        model(x)
    assert off.peak is None
    with off.track(model):
        model(x)
    with off.track(model):
        model(torch.randn(50, 16))
    assert off.peak == (5 * 16 + 5 * 32) * 4


def test_activation_tracker_keeps_what_a_failing_first_forward_saved():
    class Boom(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), Boom(32, 8), torch.nn.Linear(8, 8))
    tracker = ActivationTracker(False)
    with pytest.raises(RuntimeError), tracker.track(model):
        model(torch.randn(5, 16))
    assert tracker.peak is None and tracker.partial == (5 * 16 + 5 * 32) * 4
    assert tracker.partial_share == 2 / 3  # the first Linear and Boom began, the last Linear did not
