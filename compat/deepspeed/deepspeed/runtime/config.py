from shardwise.config import ConfigError as DeepSpeedConfigError
from shardwise.config import parse_config as DeepSpeedConfig

__all__ = ["DeepSpeedConfig", "DeepSpeedConfigError"]
