"""What every rank must agree on before training starts, and the check `initialize` makes of it.

The fingerprint has six sections, compared by `distributed/agreement.py` (one all-gather of digests):
the launch ("world": world size, backend, device type, versions, SHARDWISE_SHM_COLLECTIVES), the parsed
config, the model's parameters (name, whole shape — also under `zero.Init` — dtype, requires_grad) and
buffers, which optimizer group holds each parameter and at which position, and each group's settings.

Not compared, because they may legitimately differ per rank (`PER_RANK_CONFIG_KEYS`): where files that
only global rank 0 writes go (TensorBoard / CSV directories and job names, the wandb run's names, the
flops profiler's output file), the NVMe swap directories (each node mounts its own disk where it likes),
and the collective timeouts (how long this rank waits; nothing it computes or sends). Nor is
LOCAL_WORLD_SIZE: a hostfile may give nodes different slot counts, and nothing depends on it agreeing.

The check runs its exchange on its own gloo-or-NCCL `Collectives` with shared memory off, so that ranks
that disagree about SHARDWISE_SHM_COLLECTIVES can still compare (and refuse) instead of hanging.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from ..config import Config
from ..distributed import CollectiveError, Collectives, Group
from ..distributed.agreement import Section, check_agreement
from ..protocols import ParamGroups
from ..version import __version__
from ..zero.stage3.registry import INIT_SHARD_OF

PER_RANK_CONFIG_KEYS = frozenset({
    "tensorboard.output_path", "tensorboard.job_name", "csv_monitor.output_path", "csv_monitor.job_name",
    "wandb.team", "wandb.group", "wandb.project", "flops_profiler.output_file",
    "zero_optimization.offload_optimizer.nvme_path", "zero_optimization.offload_param.nvme_path",
    "collective_timeout_s", "collective_warn_after_s",
})
MODEL_FIX = "Build the same model on every rank (the same code and arguments) before calling initialize."
GROUPS_FIX = "Pass every rank the same parameter groups (model_parameters= or the optimizer's param_groups)."


def check_ranks_agree(cfg: Config, model: torch.nn.Module, groups: ParamGroups, device: torch.device,
                      pipeline: dict[str, Any] | None = None) -> None:
    """Collective over the world: raise `RankMismatchError` on every rank unless all ranks have the same
    config, model, optimizer groups and launch (see the module docstring). With `pipeline` (the whole
    pipeline's description: each stage holds other layers) that is compared instead of the parameters."""
    world = dist.get_world_size()
    if world == 1:
        return
    names = {id(p): name for name, p in model.named_parameters()}
    sections = [
        Section("world", _world(device), "Launch every rank the same way: the same shardwise and torch "
                "versions, backend, device type and SHARDWISE_* environment variables."),
        Section("config", _config(cfg), "Pass every rank the same config (look for a per-rank edit, override "
                "or a value read from the environment)."),
        Section("parameters", {name: _tensor(p, _shape(p), p.requires_grad) for name, p in model.named_parameters()},
                MODEL_FIX, label="parameter '{}'"),
        Section("buffers", {name: _tensor(b, b.shape) for name, b in model.named_buffers()}, MODEL_FIX,
                label="buffer '{}'"),
        Section("optimizer groups", _membership(groups, names), GROUPS_FIX, label="parameter '{}'"),
        Section("optimizer group settings", _settings(groups), GROUPS_FIX),
    ]
    if pipeline is not None:
        sections = sections[:2] + [Section("pipeline", pipeline, MODEL_FIX), sections[-1]]
    comm = Collectives(cfg.collective_timeout_s, shm=False, warn_after_s=cfg.collective_warn_after_s)
    try:
        check_agreement(sections, comm, Group("rank-agreement", dist.group.WORLD, world, dist.get_rank()), device)
    except CollectiveError as e:
        raise type(e)(f"initialize, comparing every rank's config and model: {e}") from e


def _world(device: torch.device) -> dict[str, Any]:
    shm = os.environ.get("SHARDWISE_SHM_COLLECTIVES", "1") != "0"
    return {
        "world size": str(dist.get_world_size()), "backend": str(dist.get_backend()), "device type": device.type,
        "shardwise version": __version__, "torch version": torch.__version__.split("+")[0],
        "SHARDWISE_SHM_COLLECTIVES": "on (shared-memory collectives)" if shm else "0 (gloo only)",
    }


def _config(cfg: Config) -> dict[str, Any]:
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
        elif prefix not in PER_RANK_CONFIG_KEYS:
            flat[prefix] = repr(value) if isinstance(value, str) else _json_text(value)

    walk("", cfg.model_dump(mode="json"))
    return flat


def _json_text(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _shape(p: torch.Tensor) -> torch.Size:
    """The whole shape, also of a parameter `zero.Init` has partitioned (its local tensor is empty)."""
    return INIT_SHARD_OF[p].shape if p in INIT_SHARD_OF else p.shape


def _tensor(t: torch.Tensor, shape: torch.Size, requires_grad: bool | None = None) -> dict[str, str]:
    described = {"shape": str(tuple(shape)), "dtype": str(t.dtype).removeprefix("torch.")}
    if requires_grad is not None:
        described["requires_grad"] = str(requires_grad)
    return described


def _membership(groups: ParamGroups, names: dict[int, str]) -> dict[str, Any]:
    """Which group holds each parameter, at which position (the order sets flat-buffer layouts)."""
    entries: dict[str, Any] = {}
    for g, group in enumerate(groups):
        for position, p in enumerate(group["params"]):
            name = names.get(id(p), f"(not in the model: group {g} #{position}, shape {tuple(p.shape)})")
            entries[name] = {"group": str(g), "position": str(position)}
    return entries


def _settings(groups: ParamGroups) -> dict[str, Any]:
    return {f"group {g}": {key: _setting(value) for key, value in sorted(group.items()) if key != "params"}
            for g, group in enumerate(groups)}


def _setting(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return repr(value.item()) if value.numel() == 1 else f"tensor of shape {tuple(value.shape)}"
    simple = (bool, int, float, str, type(None))
    if isinstance(value, simple) or (isinstance(value, (tuple, list)) and all(isinstance(v, simple) for v in value)):
        return repr(value)
    return type(value).__name__
