"""ZeRO: the flat-buffer primitive, gradient buckets and the sharding strategies for stages 0-3."""

from .memory import estimate_model_states_memory, formula_bytes, measured_bytes
from .stage3.init import GatheredParameters, Init, load_state_dict_partitioned
from .stage3.registry import register_external_parameter

__all__ = [
    "GatheredParameters",
    "Init",
    "estimate_model_states_memory",
    "formula_bytes",
    "load_state_dict_partitioned",
    "measured_bytes",
    "register_external_parameter",
]
