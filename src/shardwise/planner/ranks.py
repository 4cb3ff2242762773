"""One rank of a run, as `shardwise plan` sees it before the run: the data-parallel size and the model split over
the tensor-parallel ranks, decided by the very functions `initialize` decides them with
(tensor_parallel/setup.py), so the CLI plans what the engine's step-2 check plans (see
[Note: one account of a rank]).

[Note: one account of a rank] The engine plans the module it trains, which AutoTP has already split, over its
data-parallel group (planner/probe.py). The CLI builds the whole model in one process, so it splits it here the
same way, as tensor-parallel rank 0, and plans it over the same data-parallel size with the config parsed at
that size, through the same `plan`. The split model's forward runs
its collectives on `_Rehearsal`, which gives each the shape it has in the run (an all-gather repeats this
rank's part, a sum keeps it): the values are not the run's, but the trace counts shapes only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..config import Config
from ..config.parse import parse_config
from ..distributed.topology import Group
from ..pipeline.module import PipelineModule
from ..sequence_parallel.setup import replicas, sequence_parallel_size
from ..tensor_parallel.setup import data_parallel_size, split_model, tensor_parallel_size
from ..tensor_parallel import TensorLink


@dataclass(frozen=True)
class RankLayout:
    world: int
    pipe: int
    tensor: int
    data: int
    config: Config
    """The config parsed at the data-parallel size, as `initialize` parses it."""
    sequence: int = 1
    """Ranks sharing each sequence (Ulysses): inside `data`, each holding 1/sequence of the tokens."""


def layout(model: torch.nn.Module, raw: dict[str, Any], world: int) -> RankLayout:
    """The sizes `initialize` would find for `model` and `raw` over `world` processes (no mpu)."""
    pipe = model.num_stages if isinstance(model, PipelineModule) else 1
    tensor = tensor_parallel_size(raw, model, None)
    data = data_parallel_size(world, pipe, tensor)
    sequence = sequence_parallel_size(raw, None)
    return RankLayout(world, pipe, tensor, data, parse_config(raw, dp_size=replicas(data, sequence)), sequence)


def split_as_rank(model: torch.nn.Module, ranks: RankLayout) -> None:
    """Split `model` in place as tensor-parallel rank 0 holds it in the run; nothing to do without tensor
    parallelism."""
    if ranks.tensor == 1:
        return
    if ranks.pipe > 1:  # a stage's split is decided with the other stages, over a process group
        raise ValueError(f"--model: a PipelineModule of {ranks.pipe} stages with tensor parallelism "
                         f"({ranks.tensor} ranks) is not planned by shardwise plan; plan it without "
                         "tensor_parallel, or read the engine's step-2 check (memory_breakdown: true).")
    group = Group("tensor", None, ranks.tensor, 0)  # type: ignore[arg-type]  # _Rehearsal never reads pg
    device = next(model.parameters()).device
    # the topology is read only for an mpu or a pipeline stage, neither of which is planned here
    split_model(model, ranks.config.tensor_parallel, None, TensorLink(_Rehearsal(), group), None,  # type: ignore[arg-type]
                device)


class _Done:
    def wait(self) -> None:
        return None


class _Rehearsal:
    """The tensor-parallel collectives, played by one rank alone: each leaves its output the shape it has in the
    run (see [Note: one account of a rank])."""

    def all_reduce(self, tensor: torch.Tensor, group: Group, op: Any = None) -> _Done:
        return _Done()

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group) -> _Done:
        return _Done()  # rank 0 is the source

    def __getattr__(self, name: str) -> Any:
        raise NotImplementedError(f"shardwise plan: splitting the model called the collective {name!r}, which the "
                                  "planner's one-rank rehearsal (planner/ranks.py) does not play yet; add it there.")

    def all_gather(self, output_flat: torch.Tensor, shard: torch.Tensor, group: Group) -> _Done:
        output_flat.view(group.size, -1).copy_(shard.reshape(1, -1).expand(group.size, -1))
        return _Done()

    def reduce_scatter(self, output: torch.Tensor, input_flat: torch.Tensor, group: Group) -> _Done:
        output.view(-1).copy_(input_flat.view(group.size, -1)[group.rank])
        return _Done()
