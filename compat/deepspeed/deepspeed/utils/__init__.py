"""`deepspeed.utils`: logging, ZeRO-3 leaf modules, whole-parameter access across ranks, the parallel groups."""

from shardwise.monitor.console import log_dist, logger
from shardwise.runtime.param_access import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_grad,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)
from shardwise.zero import OnDevice, get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module

from . import groups, zero_to_fp32

__all__ = [
    "OnDevice", "get_z3_leaf_modules", "groups", "log_dist", "logger", "safe_get_full_fp32_param",
    "safe_get_full_grad", "safe_get_full_optimizer_state", "safe_get_local_grad", "safe_set_full_fp32_param",
    "safe_set_full_optimizer_state", "set_z3_leaf_modules", "unset_z3_leaf_modules", "z3_leaf_module",
    "zero_to_fp32",
]
