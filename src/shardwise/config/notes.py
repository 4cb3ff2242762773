"""One-time notes about a config (a DeepSpeed key with no effect, an "auto" resolved, a section ignored).

A script builds its engine once, but tests and notebooks parse many configs in one process: each note
is logged the first time only. The set of notes already given is process-wide state on purpose (a
per-config set would repeat them); it is the one module-level global of the config package.
"""

from __future__ import annotations

import logging

_given: set[str] = set()


def note_once(logger: logging.Logger, level: int, message: str) -> None:
    """Log `message` at `level` unless this exact message was logged before in this process."""
    if message not in _given:
        _given.add(message)
        logger.log(level, message)
