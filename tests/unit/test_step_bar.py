"""The examples' progress bar (examples/step_bar.py, rich): counts steps, shows the script's figures, and
prints notes and shardwise's log lines above the bar, leaving the log handlers as they were."""

from __future__ import annotations

import io
import logging
import sys
from pathlib import Path

from rich.console import Console

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from examples.step_bar import StepBar  # noqa: E402


def test_bar_counts_steps_and_prints_notes_and_log_lines_above_it() -> None:
    out = io.StringIO()
    logger = logging.getLogger("shardwise")
    handler = logging.StreamHandler(sys.__stderr__)  # as shardwise's console handler holds it
    logger.addHandler(handler)
    try:
        with StepBar(3, initial=1, console=Console(file=out, force_terminal=True, width=120)) as bar:
            bar.update(loss="2.500", tok_s="1,000")
            logger.warning("a shardwise note")
            bar.write("step     2: validation loss 2.400")
            bar.update(loss="2.250", tok_s="1,100")
        assert handler.stream is sys.__stderr__
    finally:
        logger.removeHandler(handler)
    text = out.getvalue()
    assert "a shardwise note" in text and "step     2: validation loss 2.400" in text
    assert "3/3" in text and "loss 2.250  tok_s 1,100" in text


def test_disabled_bar_draws_nothing() -> None:
    out = io.StringIO()
    with StepBar(2, console=Console(file=out, force_terminal=True), enabled=False) as bar:
        bar.update(loss="1.0")
        bar.write("not on this rank")
    assert out.getvalue() == ""
