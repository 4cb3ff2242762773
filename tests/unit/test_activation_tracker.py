"""The engine's activation measure (profiling/activations.py) reads the graph after each forward instead of
hooking saved tensors, so backward gets exactly what was saved; it still counts what the planner's traced
profile (a saved-tensors hook, planner/shape.py) counts, activation checkpointing's kept inputs included."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from shardwise.planner.shape import ActivationProfile
from shardwise.profiling.activations import ActivationTracker


class _Scale(torch.autograd.Function):
    """Saves a parameter and records, in backward, whether the parameter itself came back."""

    seen: list[bool] = []

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        ctx.weight = weight
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        _Scale.seen.append(weight is ctx.weight)
        return grad * weight, (grad * x).sum(0)


class _Net(torch.nn.Module):
    def __init__(self, mode: str):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                                              torch.nn.Linear(32, 16)) for _ in range(3))
        self.scale = torch.nn.Parameter(torch.ones(16))
        self.mode = mode

    def forward(self, x):
        x = _Scale.apply(x, self.scale)
        for block in self.blocks:
            if self.mode == "plain":
                x = x + block(x)
            else:
                x = x + checkpoint(block, x, use_reentrant=self.mode == "reentrant")
        return x.square().mean()


@pytest.mark.parametrize("mode", ["plain", "non-reentrant", "reentrant"])
def test_counts_what_the_planner_counts_and_backward_gets_the_parameter(mode):
    net, x = _Net(mode), torch.randn(4, 16, requires_grad=True)
    traced = ActivationProfile.trace(lambda: net(x), net, micro_batch=4).saved_bytes
    tracker = ActivationTracker(enabled=True)
    with tracker.track(net):
        loss = net(x)
    assert tracker.peak == traced > 0
    _Scale.seen.clear()
    loss.backward()
    assert _Scale.seen == [True]


def test_a_failed_forward_leaves_what_the_finished_modules_saved():
    net, x = _Net("plain"), torch.randn(4, 16)
    tracker = ActivationTracker(enabled=False)
    net.blocks[2].register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(MemoryError("out of memory")))
    with pytest.raises(MemoryError), tracker.track(net):
        net(x)
    assert tracker.peak is None and tracker.partial > 0 and 0 < tracker.partial_share < 1
