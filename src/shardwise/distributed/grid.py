"""`engine.grid`: DeepSpeed's `PipelineParallelGrid` questions (which stage, which replica, which groups),
answered from the one `Topology`.

DeepSpeed's words, mapped onto the mesh (pipe × data × tensor, tensor fastest):
- "slice" / "tensor model" parallel: the tensor axis (Megatron's tensor slicing);
- "model" parallel: every axis a replica of the model is split along, pipe × tensor (the ranks sharing this
  rank's data coordinate), so its rank is `pipe_rank * tensor_size + tensor_rank`;
- `model_parallel_size` (an attribute, unlike `get_model_parallel_world_size()`): the tensor axis's size, as
  DeepSpeed's grid has it.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from .topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
    Topology,
)


class Grid:
    def __init__(self, topology: Topology):
        self._topology = topology
        self.pipe, self.data, self.tensor = topology.pipe, topology.data, topology.tensor
        sizes = topology.sizes
        self._layout: ProcessTopology = (
            PipeModelDataParallelTopology(sizes["pipe"], sizes["tensor"], sizes["data"]) if sizes["tensor"] > 1
            else PipeDataParallelTopology(sizes["pipe"], sizes["data"]))
        self.stage_id = self.pipe.rank
        self.data_parallel_id = self.data.rank
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.pipe_parallel_size, self.data_parallel_size = self.pipe.size, self.data.size
        self.model_parallel_size = self.slice_parallel_size = self.tensor.size
        self.pp_group, self.dp_group, self.slice_group = (dist.get_process_group_ranks(g.pg)
                                                          for g in (self.pipe, self.data, self.tensor))

    def topology(self) -> ProcessTopology:
        """Where every rank sits (axes pipe, data and, with tensor parallelism, model), as DeepSpeed's grid says."""
        return self._layout

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.pipe.size - 1

    def get_stage_id(self) -> int:
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def stage_to_global(self, stage_id: int, **coords: Any) -> int:
        """The global rank of stage `stage_id` with this rank's other coordinates, or those given (data=, model=)."""
        mine = self._layout.get_coord(self.global_rank)
        return self._layout.get_rank(**{**mine, "pipe": stage_id, **coords})

    def get_global_rank(self) -> int:
        return self.global_rank

    def get_pipe_parallel_rank(self) -> int:
        return self.pipe.rank

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe.size

    def get_pipe_parallel_group(self) -> dist.ProcessGroup:
        return self.pipe.pg

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size

    def get_data_parallel_rank(self) -> int:
        return self.data.rank

    def get_data_parallel_world_size(self) -> int:
        return self.data.size

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.data.pg

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.dp_group)

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

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self._topology.model.pg
