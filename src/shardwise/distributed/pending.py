"""An issued collective's bounded wait: an early warning, a hard timeout, and errors that say who is missing.

[Note: waiting for a collective] `Pending.wait` waits at most `warn_after` seconds first, which costs the fast
path nothing (one wait, as before). A collective still pending then logs once which ranks have not arrived
and goes on waiting up to the hard timeout, after which it raises `CollectiveTimeout` naming them. Who is
missing comes from `diagnose`, called only on these slow paths (`progress.py`, `ShmChannel.laggards`).
"""

from __future__ import annotations

import datetime
import logging
import time
from typing import Callable

import torch.distributed as dist

logger = logging.getLogger("shardwise")
SETTLE_S = 0.2
"""After a transport error (a peer's connection closed), how long to let the peer finish exiting before
looking whether it is still alive."""


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message carries `[rank r/W, <group> group]`."""


class CollectiveTimeout(CollectiveError):
    pass


def _timed_out(error: BaseException) -> bool:
    return "timed out" in str(error).lower()


def _waited_out(error: BaseException, work: dist.Work) -> bool:
    """Whether `error` says that our bounded wait ran out (the collective is still under way), as opposed
    to the transport having failed (the work is over, with an error that may itself mention a timeout)."""
    return _timed_out(error) and not work.is_completed()


class Pending:
    """An issued collective; `wait()` bounds the wait and turns failures into a named error."""

    def __init__(self, work: dist.Work | None, describe: str, timeout: datetime.timedelta,
                 completed: Callable[[], None] | None = None, warn_after: float = 0.0,
                 diagnose: Callable[[bool], str] | None = None):
        self._work, self._describe, self._timeout = work, describe, timeout
        self._completed, self._warn_after, self._diagnose = completed, warn_after, diagnose

    def done(self) -> bool:
        """Whether the collective has completed (a failed one counts as done: `wait()` raises its error)."""
        return self._work is None or self._work.is_completed()

    def wait(self) -> None:
        on_done, self._completed = self._completed, None
        if self._work is None:
            if on_done is not None:
                on_done()
            return
        work, self._work = self._work, None
        try:
            completed = self._wait(work)
        except RuntimeError as e:
            if _waited_out(e, work):
                raise CollectiveTimeout(self._timeout_message()) from e
            if not _timed_out(e):
                time.sleep(SETTLE_S)
            kind = CollectiveTimeout if _timed_out(e) else CollectiveError
            raise kind(f"{self._describe} failed: {e}; {self._who(final=True)}") from e
        if completed is False:
            raise CollectiveTimeout(self._timeout_message())
        if on_done is not None:
            on_done()

    def _wait(self, work: dist.Work) -> bool | None:
        total = self._timeout.total_seconds()
        if not 0 < self._warn_after < total:
            return work.wait(timeout=self._timeout)
        try:
            if work.wait(timeout=datetime.timedelta(seconds=self._warn_after)) is not False:
                return True
        except RuntimeError as e:  # gloo raises on a timed-out wait; the work can be waited on again
            if not _waited_out(e, work):
                raise
        logger.warning("%s still waiting after %g s: %s; waiting up to %g s (collective_timeout_s) before failing",
                       self._describe, self._warn_after, self._who(final=False), total)
        return work.wait(timeout=datetime.timedelta(seconds=total - self._warn_after))

    def _timeout_message(self) -> str:
        return f"{self._describe} did not complete in {self._timeout.total_seconds():g} s: {self._who(final=True)}"

    def _who(self, final: bool) -> str:
        if self._diagnose is None:
            return "which ranks have not arrived is unknown"
        try:
            return self._diagnose(final)
        except Exception as e:  # noqa: BLE001 - a failed diagnosis must not hide the collective's own error
            return f"which ranks have not arrived is unknown ({type(e).__name__}: {e})"


class AllOf:
    """Several works that together are one collective; `then` runs once all have completed."""

    def __init__(self, works: list[dist.Work], then: Callable[[], None] | None = None):
        self._works, self._then = works, then

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def wait(self, timeout: datetime.timedelta) -> bool:
        deadline = time.monotonic() + timeout.total_seconds()
        for work in self._works:
            left = datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))
            if work.wait(timeout=left) is False:
                return False
        if self._then is not None:
            self._then, then = None, self._then
            then()
        return True
