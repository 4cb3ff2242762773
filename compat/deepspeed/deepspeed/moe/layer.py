"""`deepspeed.moe.layer.MoE`: shardwise has no Mixture-of-Experts layers yet."""

from shardwise.unsupported import unsupported_class

MoE = unsupported_class("deepspeed.moe.layer.MoE", "build the model without MoE layers (or with a dense MLP) for now.")

__all__ = ["MoE"]
