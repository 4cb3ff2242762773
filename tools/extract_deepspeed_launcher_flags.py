"""Write the flags of DeepSpeed's ``deepspeed`` command, as its own parser defines them, to a JSON file.

    DS_ACCELERATOR=cpu /work/main/.dsvenv/bin/python tools/extract_deepspeed_launcher_flags.py \\
        tests/data/deepspeed_0_19_8_launcher_flags.json

Needs an importable ``deepspeed``. Its runner builds the parser inside ``parse_args`` and parses at once, so
the parser object is caught when it starts parsing. ``tests/unit/test_launcher_flags.py`` checks that
shardwise's launcher takes every flag listed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys


class _Caught(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__("parser caught")
        self.parser = parser


def deepspeed_parser() -> argparse.ArgumentParser:
    import deepspeed.launcher.runner as runner

    original = argparse.ArgumentParser.parse_args

    def catch(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise _Caught(self)

    argparse.ArgumentParser.parse_args = catch  # type: ignore[method-assign]
    try:
        runner.parse_args([])
    except _Caught as caught:
        return caught.parser
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    raise RuntimeError("deepspeed.launcher.runner.parse_args did not build a parser")


def describe(action: argparse.Action) -> dict[str, object]:
    name = type(action).__name__.removeprefix("_").removesuffix("Action") or "Store"  # _StoreTrueAction → store_true
    kind = re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()
    return {
        "option_strings": list(action.option_strings), "dest": action.dest, "kind": kind,
        "takes_value": action.nargs != 0, "type": getattr(action.type, "__name__", None),
        "default": action.default, "choices": list(action.choices) if action.choices else None,
    }  # no help texts: they are DeepSpeed's sentences; shardwise's own are in launcher/flags.py


def main(out: str) -> None:
    import deepspeed

    parser = deepspeed_parser()
    flags = [describe(a) for a in parser._actions if a.option_strings and a.dest != "help"]
    positionals = [a.dest for a in parser._actions if not a.option_strings]
    data = {"deepspeed_version": deepspeed.__version__, "command": "deepspeed (deepspeed.launcher.runner)",
            "positionals": positionals, "flags": flags}
    with open(out, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"{len(flags)} flags of deepspeed {deepspeed.__version__} written to {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/data/deepspeed_0_19_8_launcher_flags.json")
