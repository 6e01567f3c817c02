"""Rows to PostgreSQL's binary COPY format, built ahead of the transaction.

The projector encodes every append-only row of a batch while the previous batch is
still being written, then sends each table as one buffer; the transaction only moves
bytes. Binary rather than text: PostgreSQL parses no text, and the event bytes travel
as they are instead of as hex at twice their size (their COPY was the projector's most
expensive statement). Rows are formatted by psycopg's C formatter with dumpers chosen
once per column, about 3x cheaper than encoding field by field in Python.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Iterable, Sequence
from datetime import UTC
from typing import Any

from psycopg import postgres
from psycopg._copy_base import format_row_binary  # the C formatter behind Copy.write_row
from psycopg.adapt import AdaptersMap, Transformer
from psycopg.pq import Format
from psycopg.types.json import Jsonb
from psycopg.types.string import BytesBinaryDumper
from sqlalchemy import (
    BigInteger,
    Boolean,
    Connection,
    DateTime,
    Float,
    Integer,
    LargeBinary,
    SmallInteger,
    Table,
    Text,
)
from sqlalchemy.dialects.postgresql import JSONB, UUID

HEADER = b"PGCOPY\n\xff\r\n\x00" + struct.pack("!ii", 0, 0)
TRAILER = struct.pack("!h", -1)

CopyData = bytes | bytearray
"""A COPY stream: the buffer it was built in is sent as it is (a batch's event rows are
~10 MB; copying them into a `bytes` cost a millisecond or more a batch, in the preparer)."""

# PostgreSQL type of each column type the audit tables use, for psycopg's binary dumpers.
_PG_TYPES: tuple[tuple[type, str], ...] = (
    (LargeBinary, "bytea"), (Boolean, "bool"), (JSONB, "jsonb"), (UUID, "uuid"),
    (DateTime, "timestamptz"), (BigInteger, "int8"), (SmallInteger, "int2"),
    (Integer, "int4"), (Float, "float8"), (Text, "text"),
)


_ADAPTERS = AdaptersMap(postgres.adapters)
# bytea from plain bytes by the C dumper: the default one for the bytea oid also unwraps
# DB-API `Binary` objects, in Python, for every value (four per event row).
_ADAPTERS.register_dumper(bytes, BytesBinaryDumper)


def pg_type_oid(column_type: Any) -> int:
    for kind, name in _PG_TYPES:
        if isinstance(column_type, kind):
            info = postgres.types.get(name)
            assert info is not None
            return int(info.oid)
    raise TypeError(f"no binary COPY type for {column_type!r}")


class CopyFormat:
    """How rows of chosen columns of a table are written as binary COPY."""

    def __init__(self, table: Table, names: Sequence[str] | None = None, *,
                 into: str | None = None) -> None:
        """Columns `names` of `table` (default: all the client fills), copied into `table`
        or into `into`, a staging table with those columns (an extra one is a bigint)."""
        self.table = into or table.name
        self.names = tuple(names or (c.name for c in table.columns if not c.identity
                                     and c.server_default is None))
        types = [table.c[n].type if n in table.c else BigInteger() for n in self.names]
        # psycopg's own (C) binary row formatter, set up once with the column types: no
        # connection is needed, so rows are encoded ahead of the transaction.
        self._transformer = Transformer(_ADAPTERS)
        self._transformer.set_dumper_types([pg_type_oid(t) for t in types], Format.BINARY)
        self._times = [i for i, t in enumerate(types) if isinstance(t, DateTime)]
        self._get = operator.itemgetter(*self.names) if len(self.names) > 1 else (
            lambda row: (row[self.names[0]],))
        self._jsons = [i for i, t in enumerate(types) if isinstance(t, JSONB)]

    @property
    def statement(self) -> str:
        columns = ", ".join(f'"{n}"' for n in self.names)
        return f'COPY "{self.table}" ({columns}) FROM STDIN (FORMAT binary)'

    def data(self, rows: Sequence[dict[str, Any]]) -> CopyData:
        """The whole COPY stream for `rows` (empty when there are none)."""
        return self.data_of_values(map(self._get, rows)) if rows else b""

    def data_of_values(self, rows: Iterable[Sequence[Any]]) -> CopyData:
        """The COPY stream of rows given as values in `names` order. A naive time is UTC:
        the log's clock is UTC (`Envelope.new` writes it so)."""
        transformer, times, jsons = self._transformer, self._times, self._jsons
        out = bytearray(HEADER)
        empty = True
        for row in rows:
            empty = False
            values = list(row)
            for i in times:
                t = values[i]
                if t is not None and t.tzinfo is None:
                    values[i] = t.replace(tzinfo=UTC)
            for i in jsons:
                if values[i] is not None:
                    values[i] = Jsonb(values[i])
            format_row_binary(values, transformer, out)
        if empty:
            return b""
        out += TRAILER
        return out


def copy_data(conn: Connection, statement: str, data: CopyData) -> None:
    """Send one prepared COPY stream inside the connection's transaction."""
    if not data:
        return
    raw = conn.connection.driver_connection
    assert raw is not None
    with raw.cursor() as cursor, cursor.copy(statement) as copy:
        copy.write(data)
