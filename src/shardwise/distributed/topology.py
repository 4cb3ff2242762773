"""One named `pipe × data × tensor` mesh from which every process group comes.

Only `data` > 1 is exercised so far; pipeline and tensor parallelism plug into the same mesh later
without reshaping it. Components receive a `Group` (the narrowest piece), never the topology.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

AXES = ("pipe", "data", "tensor")


@dataclass(frozen=True)
class Group:
    """A process group with the name used in logs and errors, and this rank's place in it."""

    name: str
    pg: dist.ProcessGroup
    size: int
    rank: int


class Topology:
    def __init__(self, device_type: str, pipe: int = 1, data: int | None = None, tensor: int = 1):
        world = dist.get_world_size()
        if data is None:
            data = world // (pipe * tensor)
        if pipe * data * tensor != world:
            raise ValueError(
                f"pipe ({pipe}) × data ({data}) × tensor ({tensor}) = {pipe * data * tensor} must equal the "
                f"world size ({world}); choose parallel sizes whose product is the number of processes."
            )
        self.sizes = {"pipe": pipe, "data": data, "tensor": tensor}
        self.mesh: DeviceMesh = init_device_mesh(device_type, (pipe, data, tensor), mesh_dim_names=AXES)
        self.world = Group("world", dist.group.WORLD, world, dist.get_rank())

    def group(self, axis: str) -> Group:
        if axis not in self.sizes:
            raise ValueError(f"axis: must be one of {', '.join(AXES)}; got {axis!r}.")
        return Group(axis, self.mesh.get_group(axis), self.sizes[axis], self.mesh.get_local_rank(axis))

    @property
    def data(self) -> Group:
        return self.group("data")
