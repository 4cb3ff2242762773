"""Where rank, world size and master address come from: a launcher (shardwise, torchrun) or nothing.

A script run as plain `python train.py` is world size 1 on a free local port, so the same script runs
unchanged under every launcher.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int

    def export(self) -> None:
        """Write the variables torch.distributed's env:// rendezvous reads."""
        os.environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(self.local_rank),
            LOCAL_WORLD_SIZE=str(self.local_world_size),
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port),
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}: must be an integer; got {value!r}.") from None


def discover(default_port: int = 29500) -> DistEnv:
    """Read the launcher's variables; without them, a single process on a free port."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return DistEnv(0, 1, 0, 1, "127.0.0.1", free_port())
    env = DistEnv(
        rank=_int("RANK", 0),
        world_size=_int("WORLD_SIZE", 1),
        local_rank=_int("LOCAL_RANK", 0),
        local_world_size=_int("LOCAL_WORLD_SIZE", 1),
        master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int("MASTER_PORT", default_port),
    )
    if not 0 <= env.rank < env.world_size:
        raise ValueError(
            f"RANK ({env.rank}) must be in [0, WORLD_SIZE ({env.world_size})); the launcher's variables disagree. "
            "Start the script with `shardwise`, `torchrun` or plain `python`."
        )
    return env
