"""DeepSpeed 0.19.8's public names, mapped onto shardwise.

This distribution holds no training logic: every name below is shardwise's (or torch's) implementation
of the DeepSpeed API of the same name. Features shardwise does not have yet import fine and refuse, with
the reason, when used (see `shardwise.unsupported`).
"""

from ._shadow import warn_if_shadowing

warn_if_shadowing()

from shardwise import add_config_arguments, init_distributed, initialize  # noqa: E402
from shardwise.accelerator import get_accelerator  # noqa: E402
from shardwise.config import ConfigError as DeepSpeedConfigError  # noqa: E402
from shardwise.config import parse_config as DeepSpeedConfig  # noqa: E402
from shardwise.monitor.console import log_dist  # noqa: E402
from shardwise.monitor.console import logger  # noqa: E402
from shardwise.runtime.engine import Engine as DeepSpeedEngine  # noqa: E402

from . import accelerator, checkpoint, checkpointing, comm, compression, module_inject, moe, ops, runtime, utils, zero  # noqa: E402
from .inference import InferenceEngine, init_inference  # noqa: E402
from .module_inject import replace_transformer_layer  # noqa: E402
from .ops.transformer import DeepSpeedTransformerConfig, DeepSpeedTransformerLayer  # noqa: E402
from .pipe import PipelineModule  # noqa: E402
from .runtime.pipe.engine import PipelineEngine  # noqa: E402
from .runtime.tensor_parallel import tp_model_init  # noqa: E402
from .utils import OnDevice  # noqa: E402

__version__ = "0.19.8+shardwise"
__version_major__, __version_minor__, __version_patch__ = 0, 19, 8
__git_hash__ = None
__git_branch__ = None
dist = None  # DeepSpeed fills this with deepspeed.comm in initialize(); kept for scripts that read it

__all__ = [
    "DeepSpeedConfig", "DeepSpeedConfigError", "DeepSpeedEngine", "DeepSpeedTransformerConfig",
    "DeepSpeedTransformerLayer", "InferenceEngine", "OnDevice", "PipelineEngine", "PipelineModule", "__version__",
    "accelerator", "add_config_arguments", "checkpoint", "checkpointing", "comm", "compression", "get_accelerator",
    "init_distributed", "init_inference", "initialize", "log_dist", "logger", "module_inject", "moe", "ops",
    "replace_transformer_layer", "runtime", "tp_model_init", "utils", "zero",
]
