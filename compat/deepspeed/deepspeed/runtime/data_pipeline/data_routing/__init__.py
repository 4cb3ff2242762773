"""`deepspeed.runtime.data_pipeline.data_routing`: random-LTD (`shardwise.data_efficiency.random_ltd`).

`basic_layer.RandomLayerTokenDrop` is not provided: DeepSpeed's is a wrapper module that renames the layer's
parameters, and shardwise attaches random-LTD to the layer itself, so no class here would behave as it does."""

from . import helper, scheduler

__all__ = ["helper", "scheduler"]
