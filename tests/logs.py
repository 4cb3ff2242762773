"""A logging handler that keeps the messages it sees: what a forked rank logged, for its test to assert on
(pytest's caplog does not reach into the ranks tests/harness.py forks)."""

from __future__ import annotations

import logging


class LogMessages(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
