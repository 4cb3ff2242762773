"""ZeRO: the flat-buffer primitive, gradient buckets and the sharding strategies for stages 0-3."""

from .memory import estimate_model_states_memory, formula_bytes, measured_bytes

__all__ = ["estimate_model_states_memory", "formula_bytes", "measured_bytes"]
