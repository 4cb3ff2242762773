"""`deepspeed.runtime.zero.stage_1_and_2`: its model-state estimators, answered by shardwise's memory planner."""

from shardwise.planner.estimates import (estimate_zero2_model_states_mem_needs_all_cold,
                                         estimate_zero2_model_states_mem_needs_all_live)

__all__ = ["estimate_zero2_model_states_mem_needs_all_cold", "estimate_zero2_model_states_mem_needs_all_live"]
