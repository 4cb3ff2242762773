"""The launcher's own lines on stderr, filtered by ``--log_level`` / ``-q`` (stdlib only).

Levels as DeepSpeed's launcher names them. ``info``: the start line and notes about flags; ``warning``:
something the user may not expect (a port replaced, a remote host's slots run here); ``error``: why the job
failed — always printed. The threshold is passed explicitly by whoever holds the parsed options.
"""

from __future__ import annotations

import sys

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}


def say(message: str, level: str = "error", threshold: str = "info", prog: str = "shardwise") -> None:
    if LEVELS[level] >= min(LEVELS[threshold], LEVELS["error"]):  # errors are never hidden
        print(f"{prog}: {message}", file=sys.stderr, flush=True)
