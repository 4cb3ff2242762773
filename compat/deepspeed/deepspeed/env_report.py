"""`ds_report`: shardwise's report (versions, devices, which optional pieces work), with DeepSpeed's flags."""

import sys

from shardwise.launcher.report import ds_report_main as main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
