"""Rows to PostgreSQL's COPY text format, built in Python ahead of the transaction.

The projector formats every append-only row of a batch while the previous batch is
still being written, then sends each table as one buffer. psycopg's `write_row` would
do the same conversion per row inside the transaction, holding the GIL and leaving
PostgreSQL idle; one converter per column, chosen once from the column type, is also
about twice as fast as its per-value type dispatch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import Boolean, Connection, LargeBinary, Table
from sqlalchemy.dialects.postgresql import JSONB

NULL = "\\N"
_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


def _text(value: Any) -> str:
    if value is None:
        return NULL
    s = str(value)  # str, UUID, int, float (repr round-trips), datetime below
    return s.translate(_ESCAPES) if "\\" in s or "\t" in s or "\n" in s or "\r" in s else s


def _plain(value: Any) -> str:
    """Numbers, UUIDs and timestamps: their str() has nothing to escape."""
    return NULL if value is None else str(value)


def _bool(value: Any) -> str:
    return NULL if value is None else ("t" if value else "f")


def _bytea(value: Any) -> str:
    return NULL if value is None else "\\\\x" + value.hex()


def _jsonb(value: Any) -> str:
    return NULL if value is None else _text(json.dumps(value))


def converter(column_type: Any) -> Callable[[Any], str]:
    """The text form of one column's values (its Python type is fixed by the table)."""
    if isinstance(column_type, LargeBinary):
        return _bytea
    if isinstance(column_type, Boolean):
        return _bool
    if isinstance(column_type, JSONB):
        return _jsonb
    if column_type.python_type is str:
        return _text
    return _plain


class CopyFormat:
    """How rows of chosen columns of a table are written as COPY text."""

    def __init__(self, table: Table, names: Sequence[str] | None = None, *,
                 into: str | None = None) -> None:
        """Columns `names` of `table` (default: all the client fills), copied into `table`
        or into `into`, a staging table with those columns (an extra one is a number)."""
        self.table = into or table.name
        self.names = tuple(names or (c.name for c in table.columns if not c.identity
                                     and c.server_default is None))
        self._columns = [(n, converter(table.c[n].type) if n in table.c else _plain)
                         for n in self.names]

    @property
    def statement(self) -> str:
        columns = ", ".join(f'"{n}"' for n in self.names)
        return f'COPY "{self.table}" ({columns}) FROM STDIN'

    def lines(self, rows: Sequence[dict[str, Any]]) -> str:
        columns = self._columns
        return "".join(["\t".join([f(row[n]) for n, f in columns]) + "\n" for row in rows])


def copy_text(conn: Connection, statement: str, data: str) -> None:
    """Send one prepared COPY buffer inside the connection's transaction."""
    if not data:
        return
    raw = conn.connection.driver_connection
    assert raw is not None
    with raw.cursor() as cursor, cursor.copy(statement) as copy:
        copy.write(data)
