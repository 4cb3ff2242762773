"""`deepspeed.pipe`: pipeline parallelism is not in shardwise yet; these refuse when built."""

from shardwise.unsupported import unsupported_class

_INSTEAD = "train the model unsplit (ZeRO-3 partitions it across ranks) until shardwise's pipeline engine lands."
PipelineModule = unsupported_class("deepspeed.pipe.PipelineModule", _INSTEAD)
LayerSpec = unsupported_class("deepspeed.pipe.LayerSpec", _INSTEAD)
TiedLayerSpec = unsupported_class("deepspeed.pipe.TiedLayerSpec", _INSTEAD)

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
