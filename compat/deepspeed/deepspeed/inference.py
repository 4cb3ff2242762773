"""`deepspeed.init_inference`: shardwise has no inference engine yet."""

from shardwise.unsupported import unsupported_function

init_inference = unsupported_function(
    "deepspeed.init_inference", "run the trained model with plain torch (engine.module, or `shardwise checkpoint "
    "to-fp32` then from_pretrained) until shardwise's inference engine lands.")

__all__ = ["init_inference"]
