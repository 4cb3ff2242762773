"""Which ranks a pending collective is waiting for: each rank's progress, readable by its peers.

A collective that hangs is only half explained by "this rank waited 30 s"; the other half is which ranks
never arrived and where they were. Over shared memory every rank's header says so (`shm.py`). Over gloo
(or NCCL) nothing a peer can read does, so every rank keeps, per group, the number and op of the last
collective it issued — one dict assignment on the fast path — and a daemon thread copies that record to
the rendezvous store (the default process group's store) once it has stayed the same for a whole
`interval_s`: a rank that is stuck, or waiting, publishes where it is; a rank that is training (its record
changes all the time) touches the store not at all. A waiting rank reads its peers' records only when it
warns or fails, never per call.

So a record is up to two intervals behind: a rank that arrived within the last two intervals may still
read as missing (the wait warns after four). Whether a rank of this host has exited is checked by its pid.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import weakref
from dataclasses import dataclass

import torch.distributed as dist

logger = logging.getLogger("shardwise")
_KEY = "shardwise/progress"
MAX_NAMED = 8
"""Ranks described one by one in a message; the rest are counted."""


@dataclass(frozen=True)
class Laggard:
    """A rank that has not reached the collective a peer waits in."""

    rank: int
    last_call: int
    """The number of the last collective it issued on the group (0: none), and that collective's op."""
    last_op: str
    state: str = ""
    """Why it may never arrive ("exited (pid 12)"), or ""."""
    exact: bool = True
    """False when `last_call` comes from a record that may lag (a progress record, not a shm header)."""

    def describe(self) -> str:
        reached = "last reached" if self.exact else "last reported"
        where = f"{reached} call #{self.last_call}: {self.last_op}" if self.last_call else \
            "has issued no collective on this group yet"
        return f"rank {self.rank} {self.state + ', ' if self.state else ''}{where}"


def describe_laggards(laggards: list[Laggard], notes: list[str], final: bool) -> str:
    """'ranks 1, 3 never arrived (rank 1 last reached call #55: all_reduce; ...)' or what is known instead;
    `final` False (a warning while still waiting) says "have not arrived yet"."""
    if not laggards:
        return "; ".join(notes) or "every rank of the group has issued it (the transport itself may be stuck)"
    plural = "s" if len(laggards) > 1 else ""
    verb = "never arrived" if final else ("have" if plural else "has") + " not arrived yet"
    named = ", ".join(str(lag.rank) for lag in laggards[:MAX_NAMED])
    more = f" and {len(laggards) - MAX_NAMED} more" if len(laggards) > MAX_NAMED else ""
    details = "; ".join(lag.describe() for lag in laggards[:MAX_NAMED])
    return f"rank{plural} {named}{more} {verb} ({details})" + "".join(f"; {note}" for note in notes)


class ProgressBoard:
    """This rank's last collective per group, published for its peers (see the module docstring)."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._latest: dict[str, list] = {}
        self._publisher: _Publisher | None = None
        self._started = False

    def note(self, group: str, call: int, op: str) -> None:
        """Record that collective number `call` (an `op`) was issued on `group`: the fast path."""
        self._latest[group] = [call, op]
        if not self._started:
            self._start()

    def _start(self) -> None:
        self._started = True
        try:
            store = dist.distributed_c10d._get_default_store()
            rank = dist.get_rank()
            # Every rank numbers its boards in the same order (the order of their first collectives), so
            # board n of rank 0 and board n of rank 1 belong to the same Collectives.
            ordinal = store.add(f"{_KEY}/boards/{rank}", 1)
            self._publisher = _Publisher(store, f"{_KEY}/{ordinal}/", rank, self._latest, self.interval_s)
        except Exception as e:  # noqa: BLE001 - without a store, messages say who is missing is unknown
            logger.debug("shardwise: no rendezvous store for progress records (%s)", e)
            return
        weakref.finalize(self, self._publisher.stop)

    def laggards(self, group: str, ranks: list[int], call: int, op: str) -> tuple[list[Laggard], list[str]]:
        """The ranks of `ranks` whose records show they have not issued collective `call` on `group`, and
        notes on the others (a rank whose call number `call` is another op)."""
        if self._publisher is None:
            return [], ["which ranks have not arrived is unknown (no rendezvous store to read progress from)"]
        records = self._publisher.read([r for r in ranks if r != self._publisher.rank])
        laggards, notes = [], []
        for rank, record in records.items():
            reached, reached_op = (record or {}).get("calls", {}).get(group, (0, ""))
            if record is not None and reached >= call:
                if reached == call and reached_op != op:
                    notes.append(f"rank {rank}'s call #{call} is a {reached_op}, not a {op}: the ranks issue "
                                 "collectives in different orders")
                continue
            laggards.append(Laggard(rank, reached, reached_op, self._publisher.state_of(record), exact=False))
        return laggards, notes


class _Publisher:
    """The daemon thread's side: it holds only this, so a board nobody uses any more is collected."""

    def __init__(self, store: dist.Store, prefix: str, rank: int, latest: dict[str, list], interval_s: float):
        self.store, self.prefix, self.rank, self.latest, self.interval_s = store, prefix, rank, latest, interval_s
        self.host, self.namespace = socket.gethostname(), pid_namespace()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"shardwise-progress-rank{rank}", daemon=True)
        self._first = dict(latest)
        self._publish(self._first)  # peers can read this rank's record from its first collective on
        self._thread.start()

    def _publish(self, calls: dict[str, list]) -> None:
        record = {"calls": calls, "pid": os.getpid(), "host": self.host, "ns": self.namespace}
        self.store.set(f"{self.prefix}{self.rank}", json.dumps(record))

    def _run(self) -> None:
        published = previous = self._first
        while not self._stop.wait(self.interval_s):
            if not dist.is_initialized():  # the process group was destroyed: the store may be gone
                return
            current = dict(self.latest)  # one C-level copy: consistent although the main thread writes
            if current == previous and current != published:
                try:
                    self._publish(current)
                except Exception:  # noqa: BLE001 - the store is gone (the job is ending): stop reporting
                    return
                published = current
            previous = current

    def stop(self) -> None:
        """Stop publishing; waits briefly so the thread is not inside the store when the interpreter exits."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)

    def read(self, ranks: list[int]) -> dict[int, dict | None]:
        records: dict[int, dict | None] = {}
        for rank in ranks:
            key = f"{self.prefix}{rank}"
            try:
                records[rank] = json.loads(self.store.get(key)) if self.store.check([key]) else None
            except (RuntimeError, ValueError):
                records[rank] = None
        return records

    def state_of(self, record: dict | None) -> str:
        if record is not None and record["host"] == self.host and record["ns"] == self.namespace \
                and not alive(record["pid"]):
            return f"exited (pid {record['pid']})"
        return ""


def pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def alive(pid: int | None) -> bool:
    """Whether process `pid` (of this host and pid namespace) still runs; a zombie has exited."""
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in (b"Z", b"X")
