"""``shardwise config schema``: print the config's JSON schema (``schema.py``), for editors."""

from __future__ import annotations

import argparse
import json
import sys

from .schema import config_json_schema


SCHEMA_HELP = """Print the JSON schema (draft 2020-12) of shardwise / DeepSpeed config files:

    shardwise config schema > ds_config.schema.json

Point an editor at the file (VS Code: a "json.schemas" entry in settings.json whose "fileMatch" names
your config files) to have keys completed, and typos, wrong types and values shardwise refuses marked as
you type. "auto" is allowed where shardwise accepts it, and DeepSpeed's other key spellings are known."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardwise config", description="Tools for shardwise / DeepSpeed config files.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{schema}")
    commands.add_parser("schema", help="print the config's JSON schema (draft 2020-12), for editors",
                        description=SCHEMA_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    return parser


def main(argv: list[str] | None = None) -> int:
    build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    sys.stdout.write(json.dumps(config_json_schema(), indent=2) + "\n")
    return 0
