"""`deepspeed.utils`: logging, ZeRO-3 leaf modules, whole-parameter access across ranks, the parallel groups,
`RepeatingLoader` (DeepSpeed re-exports it here; DeepSpeedExamples' pipeline example imports it from here)."""

import sys
import types

from shardwise.monitor.console import log_dist, logger
from shardwise.runtime.data import RepeatingLoader
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

# `deepspeed.utils.logging` (DeepSpeed's logger module) made here, not as a logging.py in this folder: that file
# would shadow the standard library's logging when zero_to_fp32.py is run as a file (its folder heads sys.path).
logging = types.ModuleType(f"{__name__}.logging", "DeepSpeed's logger and log_dist (shardwise.monitor.console).")
logging.log_dist, logging.logger, logging.__all__ = log_dist, logger, ["log_dist", "logger"]
sys.modules[logging.__name__] = logging

__all__ = [
    "OnDevice", "RepeatingLoader", "get_z3_leaf_modules", "groups", "log_dist", "logger", "logging",
    "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state", "safe_get_local_grad",
    "safe_set_full_fp32_param", "safe_set_full_optimizer_state", "set_z3_leaf_modules", "unset_z3_leaf_modules",
    "z3_leaf_module", "zero_to_fp32",
]
