"""Config: the typed sections, the one parser of raw JSON/dict configs, and the table of every DeepSpeed key with
what shardwise does with it (`deepspeed_keys.py`, applied by `compat.py`)."""

from .errors import ConfigError
from .parse import parse_config
from .schema import config_json_schema
from .sections import BF16Config, Config, FP16Config, OptimizerConfig, SchedulerConfig, ZeroConfig

__all__ = [
    "BF16Config",
    "Config",
    "ConfigError",
    "FP16Config",
    "OptimizerConfig",
    "SchedulerConfig",
    "ZeroConfig",
    "config_json_schema",
    "parse_config",
]
