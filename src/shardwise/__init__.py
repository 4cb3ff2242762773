"""shardwise: train PyTorch models too large for one device, with DeepSpeed's API."""

from .config import ConfigError
from .distributed import init_distributed
from .initialize import initialize
from .runtime.engine import Engine
from .version import __version__
from .arguments import add_config_arguments

__all__ = ["ConfigError", "Engine", "__version__", "add_config_arguments", "init_distributed", "initialize"]
