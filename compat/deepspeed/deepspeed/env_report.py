"""`ds_report`: shardwise's report (versions, devices, which optional pieces work)."""

import sys

from shardwise.launcher.report import main as _report


def main() -> int:
    return int(_report([]) or 0)


__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
