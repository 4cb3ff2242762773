"""The side table from a partitioned parameter to where its data lives (and from a parameter held whole at
stages 0-2 to the strategy that keeps its master).

`GatheredParameters(params)` and `register_external_parameter(module, param)` are DeepSpeed's API and
receive bare parameters, with no engine in reach, so this table is the one deliberate module-level
registry in shardwise. It holds weak references only, and an entry dies with its parameter. (DeepSpeed's
`ds_*` attributes, which scripts read off a parameter, are computed from these tables: `ds_attributes.py`.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ...distributed import Collectives, Group


@dataclass(eq=False)
class InitShard:
    """A parameter partitioned by `zero.Init` before any engine exists: its own flat slice."""

    shape: torch.Size
    numel: int
    shard: torch.Tensor
    """This rank's `ceil(numel / world)` elements of the flattened parameter (zero-padded), in fp32."""
    group: Group
    comm: Collectives
    gathered: bool = False
    """Whole inside a `GatheredParameters` block (the parameter's data is then the gathered copy)."""

    def gather(self) -> torch.Tensor:
        """The whole parameter (a collective: every rank of the group must call it)."""
        full = torch.empty(self.shard.numel() * self.group.size, dtype=self.shard.dtype, device=self.shard.device)
        self.comm.all_gather(full, self.shard, self.group).wait()
        return full[: self.numel].view(self.shape)

    def write_back(self, values: torch.Tensor) -> None:
        """Keep this rank's slice of `values` (the whole parameter)."""
        chunk = self.shard.numel()
        flat = values.detach().reshape(-1).to(self.shard.dtype)
        lo = self.group.rank * chunk
        piece = flat[lo : lo + chunk]
        self.shard.zero_()
        self.shard[: piece.numel()] = piece


# Keyed by identity (a tensor's == is elementwise, so ordinary weak dictionaries cannot hold tensors).
UNIT_OF: WeakIdKeyDictionary = WeakIdKeyDictionary()  # Parameter -> ParamUnit
INIT_SHARD_OF: WeakIdKeyDictionary = WeakIdKeyDictionary()  # Parameter -> InitShard
EXTERNAL_PARAMS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # Module -> list[Parameter]
DS_ID_OF: WeakIdKeyDictionary = WeakIdKeyDictionary()  # Parameter -> its DeepSpeed `ds_id`, kept from zero.Init to the engine
# Parameter -> weakref to the stage 0-2 strategy holding it whole (zero/edits.py, [Note: edits reach the masters])
REPLICATED_OWNER: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Declare that `module`'s forward reads `parameter`, which belongs to another module, so ZeRO-3
    gathers it around `module`'s forward and backward too (e.g. a tied embedding used by the head)."""
    params = EXTERNAL_PARAMS.setdefault(module, [])
    if all(p is not parameter for p in params):
        params.append(parameter)
