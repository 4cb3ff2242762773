"""`add_config_arguments`: the command-line flags DeepSpeed scripts expect."""

from __future__ import annotations

import argparse


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("shardwise", "shardwise (DeepSpeed-compatible) configuration")
    group.add_argument("--deepspeed", action="store_true", default=False,
                       help="accepted for DeepSpeed scripts; shardwise is always on")
    group.add_argument("--deepspeed_config", "--shardwise_config", dest="deepspeed_config", default=None, type=str,
                       help="path to the JSON config")
    return parser
