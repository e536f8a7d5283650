"""What the command line and the demo share: aligned tables (``rich`` on a
terminal when installed) and :class:`CliError`."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["CliError", "print_table"]


class CliError(Exception):
    """Bad input: printed as one line on stderr, exit code 2."""


def _rich_console() -> Any:
    """A ``rich`` console when rich is installed and stdout is a terminal."""
    if os.environ.get("NO_COLOR") or not sys.stdout.isatty():
        return None
    try:
        return importlib.import_module("rich.console").Console()
    except ImportError:
        return None


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]], title: str | None = None) -> None:
    """Print an aligned table (with ``rich`` on a terminal when it is installed)."""
    console = _rich_console()
    if console is not None:
        table = importlib.import_module("rich.table").Table(title=title)
        for h in headers:
            table.add_column(h)
        for r in rows:
            table.add_row(*r)
        console.print(table)
        return
    widths = [len(h) for h in headers]
    for r in rows:
        for i, cell in enumerate(r):
            widths[i] = max(widths[i], len(cell))
    if title:
        print(title)

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    print(line(headers))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(line(r))
