"""`deepspeed.ops.transformer`: DeepSpeed's fused BERT-layer CUDA kernel (its training transformer layer).
shardwise builds no native ops, so there is no such layer; both names refuse when built."""

from shardwise.unsupported import unsupported_class

_INSTEAD = ("shardwise has no fused transformer kernel; keep the model's own transformer layers (in "
            "DeepSpeedExamples' BERT scripts: leave --deepspeed_transformer_kernel off).")

DeepSpeedTransformerConfig = unsupported_class("deepspeed.ops.transformer.DeepSpeedTransformerConfig", _INSTEAD)
DeepSpeedTransformerLayer = unsupported_class("deepspeed.ops.transformer.DeepSpeedTransformerLayer", _INSTEAD)

__all__ = ["DeepSpeedTransformerConfig", "DeepSpeedTransformerLayer"]
