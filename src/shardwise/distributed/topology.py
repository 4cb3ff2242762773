"""One named `pipe × data × tensor` mesh from which every process group comes.

Components receive a `Group` (the narrowest piece), never the topology. Ranks are laid out pipe-major with
tensor fastest, as DeepSpeed's `PipeModelDataParallelTopology` lays them out: global rank =
(pipe × data + data) × tensor + tensor, so a tensor-parallel group is adjacent ranks (one node's devices,
where its per-layer all-reduces belong).
"""

from __future__ import annotations

import itertools
import os
import socket
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

AXES = ("pipe", "data", "tensor")
NODE_ENV = "SHARDWISE_NODE"
"""Names this process's node where the hostname does not tell nodes apart (containers or network namespaces
sharing one hostname; tests that simulate nodes)."""
MODEL_AXIS = "model"
"""DeepSpeed's and Megatron's name for the tensor axis, accepted by `ProcessTopology`."""


@dataclass(frozen=True)
class Group:
    """A process group with the name used in logs and errors, and this rank's place in it."""

    name: str
    pg: dist.ProcessGroup
    size: int
    rank: int


@dataclass(frozen=True)
class DataSplit:
    """The data-parallel group cut into parts (its ranks on one node; ZeRO++'s secondary partitions): this
    rank's part, and which of the data group's parts it is."""

    group: Group
    index: int


def _unique(items) -> list:
    return list(dict.fromkeys(items))


class ProcessTopology:
    """Pure coordinates of a mesh (no process groups): DeepSpeed's `ProcessTopology` for scripts that pass one
    to `PipelineModule(topology=...)` or ask it where a rank sits. The last axis varies fastest."""

    def __init__(self, axes: list[str], dims: list[int]):
        if len(axes) != len(dims) or any(not isinstance(d, int) or d < 1 for d in dims):
            raise ValueError(f"axes {axes} and dims {dims}: one positive size per axis is required.")
        unknown = [a for a in axes if a not in AXES and a != MODEL_AXIS]
        if unknown:
            raise ValueError(f"axes: only {', '.join(AXES)} exist in shardwise's mesh; got {unknown}.")
        self.axes, self.dims = list(axes), list(dims)
        self._coords = list(itertools.product(*(range(d) for d in dims)))

    def world_size(self) -> int:
        return len(self._coords)

    def get_dim(self, axis: str) -> int:
        return self.dims[self.axes.index(axis)] if axis in self.axes else 1

    def get_axis_names(self) -> list[str]:
        return list(self.axes)

    def get_rank(self, **coords: int) -> int:
        if set(coords) != set(self.axes):
            raise ValueError(f"get_rank: every axis ({', '.join(self.axes)}) is required; got {sorted(coords)}.")
        return self._coords.index(tuple(coords[a] for a in self.axes))

    def get_coord(self, rank: int) -> dict[str, int]:
        return dict(zip(self.axes, self._coords[rank]))

    def filter_match(self, **coords: int) -> list[int]:
        """The ranks whose coordinates equal `coords` on the named axes."""
        return [r for r, c in enumerate(self._coords)
                if all(c[self.axes.index(a)] == v for a, v in coords.items())]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        return self.filter_match(**{axis: idx})

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """Ranks that differ only along `axis`: the members of each of its groups."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = {}
        for rank, coord in enumerate(self._coords):
            key = tuple(coord[self.axes.index(a)] for a in others)
            lists.setdefault(key, []).append(rank)
        return list(lists.values())


class PipeDataParallelTopology(ProcessTopology):
    """`num_pp` pipeline stages × `num_dp` data-parallel replicas (DeepSpeed's class of the same name)."""

    def __init__(self, num_pp: int, num_dp: int):
        super().__init__(["pipe", "data"], [num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """DeepSpeed's pipe × data × model topology (Megatron-DeepSpeed builds it); "model" is the tensor axis."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int):
        super().__init__(["pipe", "data", MODEL_AXIS], [num_pp, num_dp, num_mp])


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
        self._model = _pipe_by_tensor_group(pipe, data, tensor)
        self._nodes: list[str] | None = None
        self._data_splits: dict[str, DataSplit | None] = {}
        self._groups: dict[str, Group] = {}

    def group(self, axis: str) -> Group:
        if axis not in self._groups:  # the mesh's lookups cost ~10 us, and the step asks for its axes every time
            if axis not in self.sizes:
                raise ValueError(f"axis: must be one of {', '.join(AXES)}; got {axis!r}.")
            self._groups[axis] = Group(axis, self.mesh.get_group(axis), self.sizes[axis], self.mesh.get_local_rank(axis))
        return self._groups[axis]

    @property
    def data(self) -> Group:
        return self.group("data")

    @property
    def pipe(self) -> Group:
        return self.group("pipe")

    @property
    def tensor(self) -> Group:
        return self.group("tensor")

    @property
    def model_parallel(self) -> list[Group]:
        """The axes a model is split along (its gradient norm is summed over them): pipe and tensor, where > 1."""
        return [g for g in (self.pipe, self.tensor) if g.size > 1]

    @property
    def model(self) -> Group:
        """Every rank of this rank's model replica (pipe × tensor ranks sharing its data coordinate): DeepSpeed's
        and Megatron's "model-parallel group". One axis's group unless both are split."""
        if self._model is not None:
            return self._model
        axis = self.tensor if self.sizes["pipe"] == 1 else self.pipe
        return Group("model", axis.pg, axis.size, axis.rank)

    @property
    def nodes(self) -> list[str]:
        """Each global rank's node (`SHARDWISE_NODE`, else its hostname): a collective over the world on first use."""
        if self._nodes is None:
            nodes: list[str] = [""] * self.world.size
            dist.all_gather_object(nodes, os.environ.get(NODE_ENV) or socket.gethostname())
            self._nodes = nodes
        return self._nodes

    def data_within_node(self) -> DataSplit | None:
        """This rank's data-parallel peers on its own node, or None when each data group is on one node.
        Collective over the world on first use (every rank asks at the same point)."""
        if "node" not in self._data_splits:
            parts = [self._by_node(ranks) for ranks in self._data_members()]
            self._data_splits["node"] = None if all(len(p) == 1 for p in parts) else self._split("node", parts)
        return self._data_splits["node"]

    def data_blocks(self, size: int) -> DataSplit:
        """This rank's block of `size` consecutive data-parallel ranks (ZeRO++'s secondary partition group);
        refused when `size` does not divide the data group or a block would span nodes."""
        key = f"hpz{size}"
        if key not in self._data_splits:
            data, members = self.sizes["data"], self._data_members()
            if data % size:
                raise ValueError(f"zero_optimization.zero_hpz_partition_size: must divide the data-parallel size "
                                 f"({data}); got {size}. Set it to the number of data-parallel ranks per node.")
            parts = [[ranks[i : i + size] for i in range(0, data, size)] for ranks in members]
            for block in (b for blocks in parts for b in blocks):
                hosts = _unique(self.nodes[r] for r in block)
                if len(hosts) > 1:
                    fewest = min(len(n) for ranks in members for n in self._by_node(ranks))
                    raise ValueError(
                        f"zero_optimization.zero_hpz_partition_size: {size} puts ranks {block} of nodes {hosts} in "
                        "one secondary partition, whose backward all-gathers would cross nodes; set it to the number "
                        f"of data-parallel ranks per node (at most {fewest}), or 1 to turn it off.")
            self._data_splits[key] = self._split("hpz", parts)
        return self._data_splits[key]  # type: ignore[return-value]

    def _data_members(self) -> list[list[int]]:
        """The global ranks of every data-parallel group."""
        return ProcessTopology(list(AXES), [self.sizes[a] for a in AXES]).get_axis_comm_lists("data")

    def _by_node(self, ranks: list[int]) -> list[list[int]]:
        return [[r for r in ranks if self.nodes[r] == n] for n in _unique(self.nodes[r] for r in ranks)]

    def _split(self, name: str, parts: list[list[list[int]]]) -> DataSplit:
        """Groups for every data group's `parts` (a collective over the world); this rank's."""
        pg, _ = dist.new_subgroups_by_enumeration([p for group in parts for p in group])
        for group in parts:
            for index, part in enumerate(group):
                if self.world.rank in part:
                    return DataSplit(Group(name, pg, len(part), part.index(self.world.rank)), index)
        raise AssertionError("every rank is in one part")

    def pipe_peer(self, stage: int) -> int:
        """The global rank of pipeline stage `stage` with this rank's data and tensor coordinates."""
        return dist.get_global_rank(self.pipe.pg, stage)


def _pipe_by_tensor_group(pipe: int, data: int, tensor: int) -> Group | None:
    """The pipe × tensor group, built (by every rank, at start-up, since creating a group is collective over the
    world) only when both axes are split: otherwise it is the pipe or the tensor group, which exist already."""
    if pipe == 1 or tensor == 1:
        return None
    layout = ProcessTopology(list(AXES), [pipe, data, tensor])
    pg, _ = dist.new_subgroups_by_enumeration([layout.filter_match(data=d) for d in range(data)])
    return Group("model", pg, pipe * tensor, dist.get_rank(pg))
