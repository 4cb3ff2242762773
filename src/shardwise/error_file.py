"""The elastic agent's error file: where a failing rank leaves the message the launcher reports for it.

Stdlib only, and a leaf: the launcher's bootstrap (a script's exception or failing `sys.exit`) and the
checkpoint writer (a background save that failed unseen) both write here, in torch's `record` format
with shardwise's extras (a precise time and the host), so the launcher can name the first failure.
"""

from __future__ import annotations

import json
import os
import socket
import time

HOST_VAR = "SHARDWISE_NODE_HOST"


def host_name() -> str:
    return os.environ.get(HOST_VAR) or socket.gethostname()


def write_error_file(message: str, callstack: str) -> None:
    """What the launcher reports for this rank (nothing without an agent's TORCHELASTIC_ERROR_FILE)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    info = {"py_callstack": callstack, "timestamp": str(int(time.time())), "shardwise_time": time.time(),
            "shardwise_host": host_name()}
    with open(path, "w") as f:
        json.dump({"message": {"message": message, "extraInfo": info}}, f)
