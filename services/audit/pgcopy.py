"""Rows to PostgreSQL's binary COPY format, built in Python ahead of the transaction.

The projector encodes every append-only row of a batch while the previous batch is
still being written, then sends each table as one buffer; the transaction only moves
bytes. Binary rather than text: PostgreSQL parses no text, and the event bytes travel
as they are instead of as hex at twice their size (their COPY was the projector's most
expensive statement). One encoder per column, chosen once from the column type, is also
cheaper in Python than a per-value type dispatch.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

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
NULL = struct.pack("!i", -1)
PG_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)
MICROSECOND = timedelta(microseconds=1)

_int2 = struct.Struct("!ih").pack
_int4 = struct.Struct("!ii").pack
_int8 = struct.Struct("!iq").pack
_float8 = struct.Struct("!id").pack
_length = struct.Struct("!i").pack


def _bytes(value: bytes) -> bytes:
    return _length(len(value)) + value


def _text(value: str) -> bytes:
    return _bytes(value.encode())


def _uuid(value: Any) -> bytes:
    return b"\x00\x00\x00\x10" + value.bytes


def _timestamptz(value: datetime) -> bytes:
    if value.tzinfo is None:  # the log's clock is UTC (`Envelope.new` writes it so)
        value = value.replace(tzinfo=UTC)
    return _int8(8, (value - PG_EPOCH) // MICROSECOND)


def _bool(value: Any) -> bytes:
    return b"\x00\x00\x00\x01\x01" if value else b"\x00\x00\x00\x01\x00"


def _jsonb(value: Any) -> bytes:
    return _bytes(b"\x01" + json.dumps(value).encode())  # jsonb binary: version 1, text


def encoder(column_type: Any) -> Callable[[Any], bytes]:
    """The binary COPY field (length and value) of one column's non-NULL values."""
    for kind, encode in ((LargeBinary, _bytes), (Boolean, _bool), (JSONB, _jsonb),
                         (UUID, _uuid), (DateTime, _timestamptz),
                         (BigInteger, lambda v: _int8(8, v)),
                         (SmallInteger, lambda v: _int2(2, v)),
                         (Integer, lambda v: _int4(4, v)), (Float, lambda v: _float8(8, v)),
                         (Text, _text)):
        if isinstance(column_type, kind):
            return encode
    raise TypeError(f"no binary COPY encoder for {column_type!r}")


class CopyFormat:
    """How rows of chosen columns of a table are written as binary COPY."""

    def __init__(self, table: Table, names: Sequence[str] | None = None, *,
                 into: str | None = None) -> None:
        """Columns `names` of `table` (default: all the client fills), copied into `table`
        or into `into`, a staging table with those columns (an extra one is a bigint)."""
        self.table = into or table.name
        self.names = tuple(names or (c.name for c in table.columns if not c.identity
                                     and c.server_default is None))
        self._columns = [(n, encoder(table.c[n].type if n in table.c else BigInteger()))
                         for n in self.names]
        self._count = struct.pack("!h", len(self.names))

    @property
    def statement(self) -> str:
        columns = ", ".join(f'"{n}"' for n in self.names)
        return f'COPY "{self.table}" ({columns}) FROM STDIN (FORMAT binary)'

    def data(self, rows: Sequence[dict[str, Any]]) -> bytes:
        """The whole COPY stream for `rows` (empty when there are none)."""
        if not rows:
            return b""
        columns, count = self._columns, self._count
        out = [HEADER]
        for row in rows:
            out.append(count)
            for name, encode in columns:
                value = row[name]
                out.append(NULL if value is None else encode(value))
        out.append(TRAILER)
        return b"".join(out)


def copy_data(conn: Connection, statement: str, data: bytes) -> None:
    """Send one prepared COPY stream inside the connection's transaction."""
    if not data:
        return
    raw = conn.connection.driver_connection
    assert raw is not None
    with raw.cursor() as cursor, cursor.copy(statement) as copy:
        copy.write(data)
