"""Mixture-of-Experts helpers DeepSpeed scripts call even without MoE layers.

shardwise has no MoE layers yet (`deepspeed.moe.layer.MoE` refuses to be built), so no parameter is an
expert's. DeepSpeed marks expert parameters with `allreduce = False`; a model that carries such
parameters was built for expert parallelism, which shardwise would silently treat as ordinary data
parallelism, so that is refused.
"""

from __future__ import annotations

from typing import Any

import torch


def is_moe_param(param: torch.Tensor) -> bool:
    return getattr(param, "allreduce", True) is False


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any, max_group_size: int | None = None
                                                         ) -> list[dict[str, Any]]:
    """DeepSpeed splits expert parameters into groups of their own; with none present, the groups come back
    as a list, unchanged."""
    groups = [param_groups] if isinstance(param_groups, dict) else list(param_groups)
    for index, group in enumerate(groups):
        group["params"] = list(group["params"])
        if any(is_moe_param(p) for p in group["params"]):
            raise NotImplementedError(
                f"param group {index}: holds expert (MoE) parameters (allreduce=False); expert parallelism is not "
                "supported by shardwise yet. Build the model without MoE layers.")
    return groups
