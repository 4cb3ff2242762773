"""`engine.grid`: DeepSpeed's `PipelineParallelGrid` questions (which stage, which replica, which groups),
answered from the one `Topology`. Model parallelism here is pipe × tensor."""

from __future__ import annotations

import torch.distributed as dist

from .topology import Topology


class Grid:
    def __init__(self, topology: Topology):
        self._topology = topology
        self.pipe, self.data, self.tensor = topology.pipe, topology.data, topology.group("tensor")
        self.stage_id = self.pipe.rank
        self.data_parallel_id = self.data.rank
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def topology(self) -> Topology:
        return self._topology

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.pipe.size - 1

    def get_stage_id(self) -> int:
        return self.stage_id

    def stage_to_global(self, stage_id: int) -> int:
        return self._topology.pipe_peer(stage_id)

    def get_global_rank(self) -> int:
        return self.global_rank

    def get_pipe_parallel_rank(self) -> int:
        return self.pipe.rank

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe.size

    def get_pipe_parallel_group(self) -> dist.ProcessGroup:
        return self.pipe.pg

    def get_data_parallel_rank(self) -> int:
        return self.data.rank

    def get_data_parallel_world_size(self) -> int:
        return self.data.size

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.data.pg

    def get_slice_parallel_rank(self) -> int:
        return self.tensor.rank

    def get_slice_parallel_world_size(self) -> int:
        return self.tensor.size

    def get_slice_parallel_group(self) -> dist.ProcessGroup:
        return self.tensor.pg

    get_tensor_model_parallel_rank = get_slice_parallel_rank
    get_tensor_model_parallel_world_size = get_slice_parallel_world_size
    get_tensor_model_parallel_group = get_slice_parallel_group

    def get_model_parallel_rank(self) -> int:
        return self.pipe.rank * self.tensor.size + self.tensor.rank

    def get_model_parallel_world_size(self) -> int:
        return self.pipe.size * self.tensor.size
