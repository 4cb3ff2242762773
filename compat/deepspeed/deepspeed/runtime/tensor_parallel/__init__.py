"""`deepspeed.tp_model_init` (AutoTP): shardwise has no tensor parallelism yet."""

from shardwise.unsupported import unsupported_function

tp_model_init = unsupported_function(
    "deepspeed.tp_model_init / tensor_parallel.autotp_size",
    "use ZeRO-3 (zero_optimization.stage 3) to split the model's memory across ranks instead.")

__all__ = ["tp_model_init"]
