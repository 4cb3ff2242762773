"""Plain-text tables for the reports (comms summary, flops profile, memory breakdown), drawn by rich."""

from __future__ import annotations

import io
from typing import Sequence


def render_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]], right_from: int = 1,
                 right_until: int | None = None) -> str:
    """`columns` from `right_from` up to `right_until` (default: the last) are right-aligned (numbers); the text
    has no colour codes."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left")
    for i, name in enumerate(columns):
        right = right_from <= i and (right_until is None or i < right_until)
        table.add_column(name, justify="right" if right else "left", no_wrap=True)
    for row in rows:
        table.add_row(*(str(cell) for cell in row))
    out = io.StringIO()
    Console(file=out, width=240, color_system=None, force_terminal=False).print(table)
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines()).strip("\n")
