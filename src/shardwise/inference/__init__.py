"""Inference: `init_inference` splits a model over a tensor-parallel group with training's plans, fills it from a
checkpoint shard by shard, and generates with a static key/value cache; `shardwise serve` puts it behind an HTTP
endpoint in the shape of OpenAI's completions API."""

from .build import init_inference
from .empty_weights import empty_weights
from .engine import InferenceEngine
from .pretrained import load_pretrained
from .quantize import quantize_int8, weight_bytes

__all__ = ["InferenceEngine", "empty_weights", "init_inference", "load_pretrained", "quantize_int8", "weight_bytes"]
