"""One-time notes about a config (a DeepSpeed key with no effect, an "auto" resolved, a section ignored).

A script builds its engine once, but tests and notebooks parse many configs in one process: each note
is logged the first time only. The set of notes already given is process-wide state on purpose (a
per-config set would repeat them); it is the one module-level global of the config package.

Every rank parses the same config, so a note about the config itself is for the job, not the rank:
`note_once_per_job` gives it on global rank 0 only (eight ranks would otherwise print it eight times).
"""

from __future__ import annotations

import logging
import os

_given: set[str] = set()


def note_once(logger: logging.Logger, level: int, message: str) -> None:
    """Log `message` at `level` unless this exact message was logged before in this process."""
    if message not in _given:
        _given.add(message)
        logger.log(level, message)


def note_once_per_job(logger: logging.Logger, level: int, message: str) -> None:
    """`note_once` on global rank 0 only: for notes every rank would give alike."""
    if _global_rank() == 0:
        note_once(logger, level, message)


def _global_rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    # A config may be parsed before the process group exists (a launcher has set RANK by then).
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0
