"""`deepspeed.pipe`: shardwise's pipeline parallelism under DeepSpeed's names."""

from shardwise.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from shardwise.distributed.topology import PipeDataParallelTopology, ProcessTopology

__all__ = ["LayerSpec", "PipeDataParallelTopology", "PipelineModule", "ProcessTopology", "TiedLayerSpec"]
