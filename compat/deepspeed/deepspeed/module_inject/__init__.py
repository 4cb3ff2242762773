"""`deepspeed.module_inject`: the AutoTP switch scripts call before building a model; the layer replacement
(`replace_transformer_layer`) that swaps a model's layers for DeepSpeed's fused kernels refuses, as shardwise
has no such kernels."""

from shardwise.unsupported import unsupported_function

from . import layers

_INSTEAD = ("it swaps the model's layers for DeepSpeed's fused transformer kernels, which shardwise does not have; "
            "train the model's own layers (drop the call), and for inference use deepspeed.init_inference.")

replace_transformer_layer = unsupported_function("deepspeed.module_inject.replace_transformer_layer", _INSTEAD)
revert_transformer_layer = unsupported_function("deepspeed.module_inject.revert_transformer_layer", _INSTEAD)

__all__ = ["layers", "replace_transformer_layer", "revert_transformer_layer"]
