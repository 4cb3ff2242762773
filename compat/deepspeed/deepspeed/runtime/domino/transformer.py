"""`deepspeed.runtime.domino.transformer`: Domino's Megatron-style transformer, which overlaps its tensor-parallel
all-reduces with compute. shardwise has no Domino layers; they refuse when built."""

from shardwise.unsupported import unsupported_class

_INSTEAD = ("shardwise has no Domino layers; build the model from ordinary layers and split it with shardwise's "
            "tensor parallelism (deepspeed.tp_model_init, or the config's tensor_parallel.autotp_size).")

DominoTransformer = unsupported_class("deepspeed.runtime.domino.transformer.DominoTransformer", _INSTEAD)
DominoTransformerLayer = unsupported_class("deepspeed.runtime.domino.transformer.DominoTransformerLayer", _INSTEAD)

__all__ = ["DominoTransformer", "DominoTransformerLayer"]
