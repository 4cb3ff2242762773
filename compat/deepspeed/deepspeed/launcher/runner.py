"""The `deepspeed` command: shardwise's launcher with DeepSpeed's flags."""

import sys

from shardwise.cli import deepspeed_main as main

DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME", "main"]

if __name__ == "__main__":
    sys.exit(main())
