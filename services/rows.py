"""How the CLI prints rows: a table when it fits the terminal, one record per row when it
does not, JSON lines on request.

A table squeezed into 80 columns (the width `rich` assumes for a pipe) folds every cell
to a few letters; past the width, rows are printed as records instead, one `column: value`
line each, which stay readable at any width and greppable in a pipe.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

NARROWEST = 6
"""A column narrower than this (or than its header) is not readable: records instead."""


def cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        return ", ".join(cell(v) for v in value)
    if isinstance(value, dict):
        return json.dumps(value, default=str, sort_keys=True)
    return str(value)


def fits(console: Console, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> bool:
    """Whether the table shows every column at least as wide as its header (and
    `NARROWEST`) in the console's width."""
    borders = 3 * len(columns) + 1
    width = console.width - borders
    natural = [max([len(c), *(max((len(x) for x in r[i].splitlines()), default=0)
                             for r in rows)]) for i, c in enumerate(columns)]
    if sum(natural) <= width:
        return True
    least = [min(n, max(NARROWEST, len(c))) for n, c in zip(natural, columns, strict=True)]
    return sum(least) <= width and len(columns) <= 4


def print_rows(console: Console, columns: Sequence[str], rows: Iterable[Sequence[Any]], *,
               title: str | None = None, as_json: bool = False, markup: bool = False) -> None:
    """Rows under their column names: JSON lines, a table, or records (see the module).
    With `markup`, string cells are rich markup (colours), already escaped."""
    raw = [list(r) for r in rows]
    if as_json:
        for row in raw:
            print(json.dumps(dict(zip(columns, row, strict=True)), default=str))
        return
    shown = [[cell(v) if markup else escape(cell(v)) for v in row] for row in raw]
    text = [[Text.from_markup(v).plain for v in row] for row in shown]
    table = Table(title=title)
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in shown:
        table.add_row(*row)
    if fits(console, columns, text):
        console.print(table)
        return
    if title:
        console.print(f"[bold]{escape(title)}[/bold]")
    pad = max(len(c) for c in columns)
    for n, row in enumerate(shown):
        console.print(f"[dim]-- record {n + 1} --[/dim]")
        for column, value in zip(columns, row, strict=True):
            console.print(f"{escape(column):<{pad}}  {value}", overflow="fold",
                          highlight=False)
