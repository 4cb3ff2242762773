"""`deepspeed.moe.utils`: with no MoE layers in shardwise, no parameter is an expert's; the helpers say so."""

from shardwise.moe import is_moe_param, split_params_into_different_moe_groups_for_optimizer

__all__ = ["is_moe_param", "split_params_into_different_moe_groups_for_optimizer"]
