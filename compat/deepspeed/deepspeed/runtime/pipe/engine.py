from shardwise.pipe import PipelineEngine, PipelineError

__all__ = ["PipelineEngine", "PipelineError"]
