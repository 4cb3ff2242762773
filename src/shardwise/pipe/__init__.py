"""`shardwise.pipe` (DeepSpeed's `deepspeed.pipe`): build a model as a PipelineModule of layers and train it
with `engine.train_batch()`."""

from ..distributed.topology import PipeDataParallelTopology, ProcessTopology
from ..pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec
from ..runtime.pipe_engine import PipelineEngine, PipelineError

__all__ = ["LayerSpec", "PipeDataParallelTopology", "PipelineEngine", "PipelineError", "PipelineModule",
           "ProcessTopology", "TiedLayerSpec"]
