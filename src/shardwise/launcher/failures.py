"""Which rank failed first, and how to say so (pure: works on plain data).

[Note: first failure] When one rank dies, its peers fail a moment later inside a collective ("Connection
closed by peer") and every node reports failures. The root cause is the earliest failure that is *not* such a
consequence: failures whose message matches :data:`CONSEQUENCES`, or deaths by SIGTERM, rank after all others, then by time
(exceptions carry a precise time from ``bootstrap.py``; deaths by signal only the agent's whole second).
Because a consequence is often reported first (its node noticed sooner), the launcher waits up to
``multinode.CAUSE_GRACE_S`` for the cause's report before it stops the job, which would silence it.
"""

from __future__ import annotations

import signal
from dataclasses import asdict, dataclass
from typing import Any

# Messages of ranks that failed because a peer had already gone (gloo, NCCL, TCPStore).
CONSEQUENCES = (
    "Connection closed by peer", "Connection reset by peer", "Broken pipe", "ECONNRESET", "Connection refused",
    "NCCL communicator was aborted", "DistNetworkError", "recvValue failed", "Socket Timeout",
)
TRACEBACK_LINES = 40


@dataclass(frozen=True)
class Failure:
    rank: int
    local_rank: int
    host: str
    pid: int
    exitcode: int  # negative: killed by that signal
    message: str
    traceback: str
    time: float

    @property
    def consequence(self) -> bool:
        # SIGTERM is how agents stop the surviving ranks of a failed job, so it is an effect, not a cause
        # (when every failure is a consequence, the earliest one is still reported).
        if self.exitcode == -signal.SIGTERM:
            return True
        text = self.message + self.traceback
        return any(marker in text for marker in CONSEQUENCES)

    def how(self) -> str:
        if self.exitcode < 0:
            try:
                name = signal.Signals(-self.exitcode).name
            except ValueError:
                name = "unknown signal"
            return f"signal {-self.exitcode} ({name})"
        return f"exit code {self.exitcode}"

    def cause(self) -> str:
        """What is known beyond how the rank ended; says so when there is no traceback to look for."""
        if self.exitcode < 0:
            return ": it was killed, so there is no Python traceback"
        if self.traceback:
            return f": {self.message}" if self.message else ""
        if self.message:  # bootstrap.py notes where sys.exit was called: "sys.exit(3) at train.py:12"
            return f" from {self.message}; there is no Python traceback"
        return ", without a Python traceback (os._exit, a crash in native code, or not a Python program)"

    def summary(self) -> str:
        return (f"rank {self.rank} on host {self.host} (local rank {self.local_rank}, pid {self.pid}) failed first, "
                f"with {self.how()}{self.cause()}")

    def traceback_tail(self) -> str:
        lines = self.traceback.rstrip().splitlines()
        cut = lines[-TRACEBACK_LINES:]
        return "\n".join((["  ..."] if len(lines) > len(cut) else []) + cut)

    def exit_code(self) -> int:
        return self.exitcode if 0 < self.exitcode < 256 else 1

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Failure:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})


def first_failure(failures: list[Failure]) -> Failure:
    """The root cause among ``failures`` (see [Note: first failure])."""
    return min(failures, key=lambda f: (f.consequence, f.time, f.rank))


class RanksFailed(Exception):
    """A job's agent ended because ranks failed (whichever agent ran it: see ``local.run_agent``)."""

    def __init__(self, failures: list[Failure]) -> None:
        super().__init__(f"{len(failures)} rank(s) failed")
        self.failures = failures


class AgentStopped(Exception):
    """A job's agent was stopped by a signal and has stopped its ranks."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


def failure_from_record(rank: int, local_rank: int, pid: int, exitcode: int, record: dict[str, Any], seen_at: float,
                        host: str) -> Failure:
    """A failed rank, from what its error file holds (``error_file.py``'s format; ``{}`` when it wrote none)."""
    data = record.get("message", {})
    extra = data.get("extraInfo", {}) if isinstance(data, dict) else {}
    message = data.get("message", "") if isinstance(data, dict) else str(data)
    return Failure(
        rank=rank, local_rank=local_rank, host=extra.get("shardwise_host", host), pid=pid, exitcode=exitcode,
        message=message if extra else "", traceback=extra.get("py_callstack", ""),
        time=float(extra.get("shardwise_time", seen_at)),
    )


def from_child_failed(error: Any, host: str) -> list[Failure]:
    """Torch's ``ChildFailedError`` → :class:`Failure` per failed rank (error-file data when there is one)."""
    return [failure_from_record(rank=int(rank), local_rank=int(pf.local_rank), pid=int(pf.pid), exitcode=int(pf.exitcode),
                                record=pf.error_file_data, seen_at=float(pf.timestamp), host=host)
            for rank, pf in error.failures.items()]
