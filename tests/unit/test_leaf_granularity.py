"""stage3_module_granularity_threshold's choice of leaves (zero/stage3/leaf.py, [Note: leaves by granularity])."""

from __future__ import annotations

import sys

import torch

from shardwise.zero.stage3.leaf import granularities, set_leaves_by_granularity


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.Linear(8, 8)  # 72 elements
        self.mlp = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.GELU(), torch.nn.Linear(4, 8))  # 36 + 40


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.big = torch.nn.Linear(100, 100)  # 10100 elements, one layer
        self.act = torch.nn.ReLU()


def test_elements_per_layer_count_parameter_holding_modules_and_never_make_containers_or_torch_leaves_leaves():
    net = Net()
    sizes = {name: sizes for name, m in net.named_modules() if (sizes := granularities(net).get(id(m))) is not None}
    # A block: 148 elements over attn, the mlp's two Linears and itself (the Sequential adds no layer).
    # The net: 10396 over the blocks' 8 layers, big and itself. ModuleList, Sequential, Linear, ReLU: never.
    assert sizes == {"": 10396 // 10, "blocks.0": 148 // 4, "blocks.1": 148 // 4}


def test_the_outermost_module_at_or_below_the_threshold_becomes_the_leaf():
    net = Net()
    marked, smallest = set_leaves_by_granularity(net, 37)
    assert marked == [net.blocks[0], net.blocks[1]] and smallest == 37
    assert all(getattr(m, "_z3_leaf", False) is (m in marked) for m in net.modules())
    net = Net()
    assert set_leaves_by_granularity(net, 36) == ([], 37)  # below the smallest: nothing, and the caller is told why
    net = Net()
    assert set_leaves_by_granularity(net, 2000)[0] == [net]  # the root first: its subtree is not looked into
    assert set_leaves_by_granularity(torch.nn.ReLU(), 10**6) == ([], sys.maxsize)
