"""AutoTP's split without processes: `parallelize` on a model nothing else references (no optimizer, no
parameter list held by the caller), where the replaced whole parameters are freed while the split goes on."""

from __future__ import annotations

import torch

from shardwise.distributed.topology import Group
from shardwise.tensor_parallel import TensorLink, parallelize
from shardwise.tensor_parallel.plans import Rule
from shardwise.tensor_parallel.styles import COLWISE, ROWWISE


class _Blocks(torch.nn.Module):
    def __init__(self, blocks: int = 4, width: int = 8):
        super().__init__()
        self.up = torch.nn.ModuleList(torch.nn.Linear(width, 2 * width) for _ in range(blocks))
        self.down = torch.nn.ModuleList(torch.nn.Linear(2 * width, width) for _ in range(blocks))


def test_parallelize_splits_a_model_whose_parameters_only_it_holds() -> None:
    torch.manual_seed(0)
    model = _Blocks()
    whole = {n: p.detach().clone() for n, p in model.named_parameters()}
    link = TensorLink(comm=None, group=Group("tensor", None, 2, 1))  # splitting needs no peer
    # no reference to the old parameters survives here: their ids may be reused by the new shards
    split = parallelize(model, [Rule(r"up\.\d+", COLWISE), Rule(r"down\.\d+", ROWWISE)], link)
    for name, param in model.named_parameters():
        expected = whole[name]
        if name.startswith("up."):
            expected = expected.chunk(2, dim=0)[1]
        elif name.endswith("weight"):
            expected = expected.chunk(2, dim=1)[1]
        torch.testing.assert_close(param.detach(), expected, rtol=0, atol=0, msg=name)
    assert len(split.shards) == 12  # every up weight and bias, every down weight; down biases stay whole
