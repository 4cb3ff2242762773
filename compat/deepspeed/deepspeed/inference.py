"""`deepspeed.init_inference` and `deepspeed.InferenceEngine`: shardwise's inference engine."""

from shardwise.inference import InferenceEngine, init_inference

__all__ = ["InferenceEngine", "init_inference"]
