"""How `initialize` decides the tensor-parallel size and splits the model (shardwise.tensor_parallel).

The size comes from any of: the config's `tensor_parallel.autotp_size`, `tp_model_init(model, tp_size)`, a
Megatron-style `mpu`; those given (> 1) must agree. AutoTP splits the model when the config or
`tp_model_init` asks for it; an mpu alone means the user's layers are split already.

A `PipelineModule` holds one stage's layers: a stage may hold only whole ones (a stage of norms), so what must
be split somewhere is decided over every stage (one all-reduce over the pipe group), identically on each rank.
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import ConfigError
from ..config.sections import TensorParallelConfig
from ..distributed import Collectives, Group, Topology
from ..pipeline.module import PipelineModule
from . import TensorLink, TensorParallelError, TensorParallelModel, parallelize, resolve_plan
from .megatron import check_mpu_groups, megatron_split, mpu_tensor_size, recorded_init
from .sync import sync_from_first


def tensor_parallel_size(raw: dict[str, Any], model: torch.nn.Module, mpu: Any) -> int:
    section = raw.get("tensor_parallel") or {}
    sources = {"tensor_parallel.autotp_size": section.get("autotp_size", 0) if isinstance(section, dict) else 0}
    recorded = recorded_init(model)
    if recorded is not None:
        sources["tp_model_init(tp_size=...)"] = recorded["tp_size"]
    if mpu is not None:
        sources["mpu's model-parallel world size"] = mpu_tensor_size(mpu)
    sizes = {k: v for k, v in sources.items() if isinstance(v, int) and not isinstance(v, bool) and v > 1}
    if len(set(sizes.values())) > 1:
        raise ConfigError([f"tensor_parallel: the tensor-parallel sizes given differ ({sizes}); give one size."])
    return next(iter(sizes.values()), 1)


def data_parallel_size(world: int, pipe: int, tensor: int) -> int:
    if world % (pipe * tensor):
        raise ConfigError([f"tensor_parallel.autotp_size: {pipe} pipeline stage(s) x {tensor} tensor-parallel ranks = "
                           f"{pipe * tensor} does not divide the world size ({world}); choose sizes whose product "
                           "divides the number of processes."])
    return world // (pipe * tensor)


def split_model(model: torch.nn.Module, config: TensorParallelConfig, mpu: Any, link: TensorLink,
                topology: Topology, device: torch.device) -> TensorParallelModel | None:
    """Split `model` in place over `link`'s group; None when the tensor-parallel size is 1."""
    if mpu is not None:
        _check_mpu(mpu, link.comm, topology, device)
    if link.size == 1:
        return None
    if config.autotp_size <= 1 and recorded_init(model) is None:
        return megatron_split(model, link)  # an mpu's own layers
    if any(getattr(p, "ds_id", None) is not None for p in model.parameters()):
        raise TensorParallelError("tensor_parallel: the model was built under zero.Init (its parameters are ZeRO-3 "
                                  "partitioned), so AutoTP cannot split it; build it normally and let ZeRO-3 "
                                  "partition the tensor-parallel shards at initialize.")
    stage_only = isinstance(model, PipelineModule)
    rules = resolve_plan(model, config.partition_config, config.preset_model, config.vocab_parallel_lm_head,
                         required=not stage_only, sequence_parallel=config.sequence_parallel)
    sync_from_first(model, link, device)  # replicated and split parameters from one model, whatever each rank built
    split = parallelize(model, rules, link, config.sequence_parallel, require_match=not stage_only)
    if stage_only:
        _check_some_stage_split(split, link.comm, topology.pipe, device)
    return split


def _check_mpu(mpu: Any, comm: Collectives, topology: Topology, device: torch.device) -> None:
    """Refuse an mpu whose groups are not shardwise's on every rank together: a rank whose own groups match would
    otherwise go on to the first collective and wait there for the ranks that raised."""
    try:
        check_mpu_groups(mpu, topology.tensor.pg, topology.data.pg)
        problem = None
    except TensorParallelError as e:
        problem = e
    failed = torch.tensor([int(problem is not None)], dtype=torch.int64, device=device)
    comm.all_reduce(failed, topology.world).wait()
    if problem is not None:
        raise problem
    if failed.item():
        raise TensorParallelError(f"mpu: its groups differ from shardwise's on {failed.item()} other rank(s), though "
                                  "not on this one; see those ranks' errors, and build the mpu's groups with adjacent "
                                  "ranks in a tensor group, as Megatron does.")


def _check_some_stage_split(split: TensorParallelModel, comm: Collectives, pipe: Group, device: torch.device) -> None:
    count = torch.tensor([len(split.split_modules)], dtype=torch.int64, device=device)
    comm.all_reduce(count, pipe).wait()
    if count.item() == 0:
        raise TensorParallelError("tensor_parallel.autotp_size: no stage of the PipelineModule has a module to split, "
                                  "so every tensor-parallel rank would compute the same thing; build its layers with "
                                  "shardwise.tensor_parallel.layers (ColumnParallelLinear, RowParallelLinear, "
                                  "VocabParallelEmbedding), give tensor_parallel.partition_config.layer_specs, or set "
                                  "autotp_size to 1.")
