"""What every terminal rendering shares: the rich console, a key-value table, signed percentages.
rich is loaded only when a table is printed (never for --json)."""
from __future__ import annotations

import sys
from typing import Any

from ..core.units import fmt_bytes


def console(wide: bool = False):
    """A rich Console on stdout; ``wide``: 200 columns when stdout is not a terminal (tables piped to a file)."""
    from rich.console import Console  # rich: tables only, not for --json

    if wide:
        return Console(soft_wrap=False, width=None if sys.stdout.isatty() else 200)
    return Console(soft_wrap=False)


def kv_table(rows: list[tuple[str, str, str]], title: str | None = None):
    """Label (bold), value (right-aligned), remark (dim), without a header or a box."""
    from rich.table import Table  # rich: tables only, not for --json

    t = Table(title=title, show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    t.add_column(style="dim")
    for r in rows:
        t.add_row(*r)
    return t


def rows_table(title: str, columns: list[str], rows, left: tuple[str, ...] = ()):
    """A titled table without a box: ``columns`` right-aligned except those named in ``left``; ``rows``: lists of
    cell strings."""
    from rich.table import Table  # rich: tables only, not for --json

    t = Table(title=title, box=None)
    for col in columns:
        t.add_column(col, justify="left" if col in left else "right")
    for r in rows:
        t.add_row(*r)
    return t


def signed_pct(x: Any) -> str:
    """+12.5% / -3.0% of a fraction; '-' for None.

    >>> signed_pct(0.125), signed_pct(None)
    ('+12.5%', '-')
    """
    return "-" if x is None else f"{x * 100:+.1f}%"


def budget_line(d: Any) -> str:
    """The fit rule's line under a table whose rows say whether they fit (compare, sweep)."""
    return (f"[dim]fits: peak reserved + CUDA context <= budget - margin: peak reserved <= {fmt_bytes(d.usable_bytes)} "
            f"(budget {fmt_bytes(d.budget_bytes)} - CUDA context {fmt_bytes(d.context_bytes)} - margin {fmt_bytes(d.margin_bytes)})[/dim]")
