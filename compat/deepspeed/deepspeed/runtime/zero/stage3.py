"""`deepspeed.runtime.zero.stage3`: its model-state estimators, answered by shardwise's memory planner."""

from shardwise.planner.estimates import (estimate_zero3_model_states_mem_needs_all_cold,
                                         estimate_zero3_model_states_mem_needs_all_live, model_to_params)

__all__ = ["estimate_zero3_model_states_mem_needs_all_cold", "estimate_zero3_model_states_mem_needs_all_live",
           "model_to_params"]
