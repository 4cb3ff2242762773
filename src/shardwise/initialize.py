"""Wiring: config → topology → precision → strategy → Engine; returns DeepSpeed's 4-tuple."""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch
import torch.distributed as dist

from . import accelerator
from .config import Config, ConfigError, parse_config
from .config.parse import load_raw
from .config.notes import note_once_per_job
from .config.training import COMPRESSED_OPTIMIZER_NAMES
from .data_efficiency.random_ltd import attach_random_ltd
from .distributed import Collectives, Group, Topology, init_distributed
from .distributed.groups import record as record_groups
from .monitor.console import ensure_console_handler
from .optim.onebit.base import CompressedOptimizer
from .optim.param_groups import check_model_parameters
from .optim.registry import build_optimizer, build_scheduler, check_optimizer, check_scheduler
from .precision import PrecisionPolicy
from .precision.autocast import check_autocast
from .protocols import MakeOptimizer, ParamGroups, StrategyInputs
from .runtime.curriculum_surface import build_training_loader
from .runtime.data import DistributedLoader
from .pipeline.module import PipelineModule
from .runtime.engine import Engine
from .runtime.pipe_engine import PipelineEngine
from .runtime.rank_fingerprint import check_ranks_agree
from .sparse_attention.apply import apply_sparse_attention
from .sequence_parallel.data import SequenceShardLoader
from .sequence_parallel.setup import (AttentionWitness, check_companions, is_sequence_mpu, replicas,
                                      sequence_parallel_size, setup_sequence_parallel)
from .tensor_parallel.setup import data_parallel_size, split_model, tensor_parallel_size
from .tensor_parallel import TensorLink
from .zero.factory import make_strategy

OptimizerArg = torch.optim.Optimizer | Callable[[ParamGroups], torch.optim.Optimizer] | None

logger = logging.getLogger(__name__)


def initialize(
    args: Any = None,
    model: torch.nn.Module | None = None,
    optimizer: OptimizerArg = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: torch.utils.data.Dataset | None = None,
    lr_scheduler: Any = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    config: str | Path | Mapping[str, Any] | None = None,
    config_params: str | Path | Mapping[str, Any] | None = None,
    distributed_port: int = 29500,
    mesh_param: Any = None,
) -> tuple[Engine, torch.optim.Optimizer, DistributedLoader | None, Any]:
    """Build a training engine around `model`: `(engine, optimizer, training_dataloader, lr_scheduler)`."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: an nn.Module is required; got {type(model).__name__}.")
    if mesh_param is not None:
        raise ValueError(f"mesh_param: sequence-parallel meshes are not supported yet; got {mesh_param!r}. Drop it.")
    raw = _config_source(args, config, config_params)
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    ensure_console_handler()
    pipe = model.num_stages if isinstance(model, PipelineModule) else 1
    raw = load_raw(raw)
    sequence = sequence_parallel_size(raw, mpu)
    if is_sequence_mpu(mpu):
        mpu = None  # its "model-parallel" getters are the sequence ones, not tensor parallelism
    tensor = tensor_parallel_size(raw, model, mpu)
    cfg = parse_config(raw, dp_size=replicas(data_parallel_size(dist.get_world_size(), pipe, tensor), sequence))
    _check_pipeline(cfg, model)
    check_companions(cfg, sequence)
    apply_sparse_attention(model, cfg.sparse_attention)
    groups = _param_groups(optimizer, model_parameters, model)
    if _forward_only(optimizer, lr_scheduler, cfg, model):
        groups, make_optimizer = [], _no_optimizer  # nothing trains: no masters, no optimizer state
    else:
        check_model_parameters(groups, model, given=model_parameters is not None or isinstance(optimizer, torch.optim.Optimizer))
        make_optimizer = _optimizer_factory(optimizer, cfg)
        _validate_scheduler(cfg, lr_scheduler)
    names = {id(p): n for n, p in model.named_parameters()}
    group_names = [[names[id(p)] for p in g["params"] if id(p) in names] for g in groups]
    if cfg.seed is not None:
        _seed_everything(cfg.seed)

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = accelerator.device_for(local_rank)
    check_autocast(cfg.torch_autocast, device)
    # before any collective that would hang on a difference
    check_ranks_agree(cfg, model, groups, device, model.describe() if pipe > 1 else None)
    topology = Topology(device.type, pipe=pipe, tensor=tensor)
    record_groups(topology)  # for deepspeed.utils.groups' argument-less getters
    comm = Collectives(cfg.collective_timeout_s, warn_after_s=cfg.collective_warn_after_s)
    sequence_link = setup_sequence_parallel(model, sequence, pipe, tensor, comm)
    split = split_model(model, cfg.tensor_parallel, mpu, TensorLink(comm, topology.tensor), topology, device)
    if split is not None:
        groups = split.remap(groups)
    model.to(device)
    _broadcast_module(model, topology.data, comm)
    random_ltd = attach_random_ltd(model, cfg, topology.data.rank)  # before the strategy wraps the model
    precision = PrecisionPolicy.from_config(cfg)
    strategy = make_strategy(StrategyInputs(
        module=model, param_groups=groups, make_optimizer=make_optimizer, precision=precision,
        dp_group=topology.data, comm=comm, zero=cfg.zero_optimization,
        prescale_gradients=cfg.prescale_gradients, gradient_predivide_factor=cfg.gradient_predivide_factor,
        aio=cfg.aio, counts_in_norm=split.counts_in_norm if split is not None else None,
        compressed_optimizer=_compresses(optimizer, cfg, pipe),
        **_data_splits(cfg, topology),
    ))
    scheduler = _make_scheduler(cfg, lr_scheduler, strategy.optimizer)
    engine_class = PipelineEngine if isinstance(model, PipelineModule) else Engine
    engine = engine_class(cfg, topology, strategy, precision, comm, scheduler, device, local_rank, split)
    engine.random_ltd_scheduler = random_ltd
    engine.client_optimizer = optimizer  # optimizer_name() reports it, as DeepSpeed's does
    engine.param_group_names = group_names  # each optimizer group's parameters by name: checkpoint export needs them
    if sequence_link is not None:
        engine.sequence_witness = AttentionWitness(sequence_link)
    loader = None
    if training_data is not None:
        # a curriculum loader under data_efficiency's data-sampling curriculum; DeepSpeed's pipeline reads in order
        loader = build_training_loader(cfg, topology, training_data, collate_fn,
                                       shuffle=not isinstance(model, PipelineModule))
        if sequence_link is not None:
            loader = SequenceShardLoader(loader, sequence_link, device)
        engine.training_dataloader = loader
    return engine, engine.optimizer, loader, scheduler


def _data_splits(cfg: Config, topology: Topology) -> dict[str, Any]:
    """Stage 3's node and ZeRO++ groups (collectives over the world, made by every rank here)."""
    zero = cfg.zero_optimization
    if zero.stage != 3:
        return {}
    hpz = topology.data_blocks(zero.zero_hpz_partition_size) if zero.zero_hpz_partition_size > 1 else None
    return {"node_split": topology.data_within_node(), "hpz_split": hpz}


def _check_pipeline(cfg: Config, model: torch.nn.Module) -> None:
    stages = cfg.pipeline.stages
    if isinstance(model, PipelineModule) and (cfg.curriculum_learning or cfg.data_efficiency.curriculum):
        raise ConfigError(["curriculum_learning: curriculum learning with a PipelineModule is not supported yet; got "
                           "a pipeline model. Train without the curriculum, or without pipeline parallelism."])
    if not isinstance(model, PipelineModule):
        if stages not in ("auto", 1):
            raise ConfigError([f"pipeline.stages: {stages} pipeline stages need a PipelineModule model; got a "
                               f"{type(model).__name__}. Build the model as shardwise.pipe.PipelineModule(layers, "
                               "num_stages=...) or remove the key."])
        return
    if stages != "auto" and stages != model.num_stages:
        raise ConfigError([f"pipeline.stages: {stages} differs from the PipelineModule's num_stages "
                           f"({model.num_stages}); make them equal or set \"auto\"."])


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "shardwise_config", None)
    given = [c for c in (config, config_params, from_args) if c is not None]
    if not given:
        raise ConfigError(["config: none given; pass config= (a dict or a JSON path) or --deepspeed_config PATH."])
    if len(given) > 1:
        raise ConfigError(["config: given more than once (config=, config_params= or args.deepspeed_config); pass exactly one."])
    return given[0]


def _param_groups(optimizer: OptimizerArg, model_parameters: Iterable[Any] | None, model: torch.nn.Module) -> ParamGroups:
    if isinstance(optimizer, torch.optim.Optimizer):
        return [dict(g) for g in optimizer.param_groups]
    params = list(model_parameters) if model_parameters is not None else list(model.parameters())
    if params and isinstance(params[0], dict):
        return [{**g, "params": list(g["params"])} for g in params]
    return [{"params": params}]


def _compresses(optimizer: OptimizerArg, cfg: Config, pipe: int) -> bool:
    """Whether the optimizer exchanges compressed momentum itself (then the strategy lets it: `compressed_dp.py`)."""
    if isinstance(optimizer, CompressedOptimizer):
        raise TypeError(f"optimizer: a {type(optimizer).__name__} instance cannot be passed to initialize(); name it "
                        'in the config ("optimizer": {"type": "' + type(optimizer).__name__ + '", "params": {...}}), '
                        "so the engine builds it over the parameters it trains and connects it to the data group.")
    compresses = optimizer is None and cfg.optimizer is not None and cfg.optimizer.type in COMPRESSED_OPTIMIZER_NAMES
    if compresses and pipe > 1:
        raise ConfigError([f"optimizer.type: {cfg.optimizer.type} with pipeline parallelism is not supported yet; got "
                           f"{pipe} stages. Use Adam with the pipeline, or {cfg.optimizer.type} without it."])
    return compresses


def _optimizer_factory(optimizer: OptimizerArg, cfg: Config) -> MakeOptimizer:
    if optimizer is not None and cfg.optimizer is not None:
        note_once_per_job(logger, logging.WARNING,
                  f"optimizer: the optimizer passed to initialize() is used and the config's \"optimizer\" section "
                  f"(type {cfg.optimizer.type!r}, params {cfg.optimizer.params}) is ignored, as DeepSpeed does. "
                  "Remove one of the two to silence this.")
    if isinstance(optimizer, torch.optim.Optimizer):
        return _rebind(optimizer)
    if callable(optimizer):
        return lambda groups: optimizer([g for g in groups if g["params"]])
    if cfg.optimizer is None:
        raise ConfigError(['optimizer: none given; pass optimizer= to initialize or add an "optimizer" section.'])
    opt_cfg = cfg.optimizer
    check_optimizer(opt_cfg)  # every rank alike, before anything is built
    build_optimizer(opt_cfg, [{"params": [torch.nn.Parameter(torch.zeros(1))]}])
    return lambda groups: build_optimizer(opt_cfg, [g for g in groups if g["params"]])


def _forward_only(optimizer: OptimizerArg, lr_scheduler: Any, cfg: Config, model: torch.nn.Module) -> bool:
    """No optimizer passed or configured: DeepSpeed then builds an engine that runs forward only (at stage 3 its
    parameters partitioned and gathered for each forward), as TRL's reference models and Hugging Face's
    evaluation-only runs are prepared. Stages 1-2 partition optimizer state, so they need one (DeepSpeed asserts so
    too); a pipeline trains by train_batch only."""
    if optimizer is not None or cfg.optimizer is not None:
        return False
    stage = cfg.zero_optimization.stage
    if isinstance(model, PipelineModule) or stage in (1, 2):
        what = "a PipelineModule" if isinstance(model, PipelineModule) else f"ZeRO stage {stage}"
        raise ConfigError([f'optimizer: none given; {what} needs one. Pass optimizer= to initialize or add an '
                           '"optimizer" section (or, for a model that only runs forward, use stage 0 or 3).'])
    if lr_scheduler is not None:
        raise ValueError("lr_scheduler: given without an optimizer, so there is nothing for it to schedule; pass "
                         "optimizer= to initialize (or an \"optimizer\" section) as well, or drop lr_scheduler.")
    if cfg.scheduler is not None:
        note_once_per_job(logger, logging.WARNING, f"scheduler: ignored (type {cfg.scheduler.type!r}): there is no "
                          "optimizer for it to schedule, as in DeepSpeed. Add an \"optimizer\" section to train.")
    return True


def _no_optimizer(groups: ParamGroups) -> None:
    return None


def _rebind(optimizer: torch.optim.Optimizer) -> MakeOptimizer:
    """Point a client optimizer's groups at the strategy's parameters, keeping its hyper-parameters."""

    def make(groups: ParamGroups) -> torch.optim.Optimizer:
        if optimizer.state:
            raise ValueError("optimizer: it already holds state (it has stepped); pass a freshly built optimizer.")
        for group, mapped in zip(optimizer.param_groups, groups):
            group["params"] = mapped["params"]
        return optimizer

    return make


def _validate_scheduler(cfg: Config, lr_scheduler: Any) -> None:
    if lr_scheduler is not None and cfg.scheduler is not None:
        note_once_per_job(logger, logging.WARNING,
                  f"lr_scheduler: the scheduler passed to initialize() is used and the config's \"scheduler\" section "
                  f"(type {cfg.scheduler.type!r}) is ignored, as DeepSpeed does. Remove one of the two to silence this.")
    elif cfg.scheduler is not None:
        check_scheduler(cfg.scheduler)


def _make_scheduler(cfg: Config, lr_scheduler: Any, optimizer: torch.optim.Optimizer) -> Any:
    if lr_scheduler is not None:
        return lr_scheduler(optimizer) if callable(lr_scheduler) and not hasattr(lr_scheduler, "step") else lr_scheduler
    if cfg.scheduler is None or optimizer is None:  # no optimizer: forward only, the section ignored
        return None
    return build_scheduler(cfg.scheduler, optimizer)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _broadcast_module(model: torch.nn.Module, group: Group, comm: Collectives) -> None:
    """Start every data-parallel rank from rank 0's weights and buffers, as DDP does."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            comm.broadcast(tensor.data, 0, group).wait()
