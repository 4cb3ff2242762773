"""ZeRO: the flat-buffer primitive, gradient buckets, the sharding strategies for stages 0-3 (the one that
chooses is `factory.py`), ZeRO++'s quantized collectives and `shardwise estimate`."""

from ..profiling.memory import estimate_model_states_memory, formula_bytes, measured_bytes
from .on_device import OnDevice
from .stage3.ds_attributes import ZeroParamStatus
from .stage3.init import GatheredParameters, Init, load_state_dict_partitioned
from .stage3.leaf import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module
from .stage3.registry import register_external_parameter

__all__ = [
    "GatheredParameters",
    "Init",
    "OnDevice",
    "ZeroParamStatus",
    "estimate_model_states_memory",
    "formula_bytes",
    "get_z3_leaf_modules",
    "load_state_dict_partitioned",
    "measured_bytes",
    "register_external_parameter",
    "set_z3_leaf_modules",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
]
