"""shardwise: train PyTorch models too large for one device, with DeepSpeed's API.

The public names load on first use, so `shardwise --help` and the launcher start without importing
the training stack.
"""

from __future__ import annotations

import importlib
from typing import Any

from .version import __version__

_PUBLIC = {
    "initialize": ".initialize",
    "init_distributed": ".distributed.init",
    "add_config_arguments": ".arguments",
    "ConfigError": ".config.errors",
    "Engine": ".runtime.engine",
    "PipelineEngine": ".runtime.pipe_engine",
    "tp_model_init": ".tensor_parallel.megatron",
    "init_inference": ".inference.build",
    "InferenceEngine": ".inference.engine",
}

_SUBMODULES = ("inference", "pipe", "zero")

__all__ = ["__version__", *_PUBLIC, *_SUBMODULES]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'shardwise' has no attribute {name!r}")
