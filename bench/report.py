"""How every benchmark reports: per-run tables on stderr, one machine-readable line on stdout.

rich is imported only when a table is built, so that loading the commands (for
``meshbus --help``) stays cheap.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.table import Table


def new_table(title: str, columns: Sequence[str]) -> Table:
    """A table with right-aligned ``columns``."""
    from rich.table import Table

    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="right")
    return table


def print_tables(*renderables: Any) -> None:
    """Print on stderr: stdout carries only the last line."""
    from rich.console import Console

    console = Console(stderr=True)
    for renderable in renderables:
        console.print(renderable)


def summary_rows(table: Table, figures: dict[str, list[float]], width: int) -> None:
    """median / min / max rows under a per-run table: one cell per figure column, in order."""
    table.add_section()
    for name, pick in (("median", statistics.median), ("min", min), ("max", max)):
        cells = [f"{pick(values):.1f}" for values in figures.values()]
        table.add_row(name, *cells, *([""] * (width - len(cells))))


def key_values(**pairs: str) -> str:
    """The machine-readable last line: ``key=value ...``, values formatted by the caller."""
    return " ".join(f"{key}={value}" for key, value in pairs.items())
