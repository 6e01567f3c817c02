"""Alembic upgrade head / downgrade base on PostgreSQL 18 (embedded wheel) and 15 (Debian)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import inspect, text

from services.audit.db import downgrade, make_engine, upgrade
from services.audit.tables import metadata
from services.config import Settings
from services.stack.postgres import LocalPostgres
from tests.conftest import service_dir

pytestmark = pytest.mark.slow


def _debian_pg15() -> Path | None:
    candidate = Path("/usr/lib/postgresql/15/bin")
    return candidate if (candidate / "postgres").exists() else None


@pytest.fixture(scope="module")
def pg15_url() -> Iterator[str]:
    bin_dir = _debian_pg15()
    if bin_dir is None:
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL 15 is not installed; .ci/run installs Debian's postgresql")
        pytest.skip("Debian's PostgreSQL 15 is not installed (apt-get install postgresql)")
    with service_dir("pg15") as where:
        server = LocalPostgres(where, bin_dir=bin_dir)
        server.start()
        assert "15." in server.version
        try:
            yield server.url
        finally:
            server.stop()


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names()) | set(inspect(engine).get_view_names())
    finally:
        engine.dispose()


def _round_trip(url: str) -> None:
    upgrade(url)
    created = _tables(url)
    assert set(metadata.tables) <= created
    engine = make_engine(url)
    try:
        inspector = inspect(engine)
        for name, table in metadata.tables.items():
            in_db = {c["name"] for c in inspector.get_columns(name)}
            assert in_db == {c.name for c in table.columns}, f"tables.py vs migrations: {name}"
    finally:
        engine.dispose()
    downgrade(url)
    assert _tables(url) <= {"alembic_version"}
    upgrade(url)  # and back up again: downgrade really undid everything
    assert set(metadata.tables) <= _tables(url)


def test_migrations_round_trip_on_postgres_18(settings: Settings) -> None:
    assert settings.database_url
    _round_trip(settings.database_url)


def test_migrations_round_trip_on_postgres_15(pg15_url: str) -> None:
    _round_trip(pg15_url)


def test_the_embedded_server_is_durable(database_url: str) -> None:
    """The store presented as tamper-evident evidence survives a power cut: WAL is
    fsynced with full-page images; only the commit wait is asynchronous (the projector's
    offsets commit with its rows, and it commits synchronously whatever it publishes)."""
    if os.environ.get("LORAPLANE_TEST_DATABASE_URL"):
        pytest.skip("an external PostgreSQL: its durability is its operator's choice")
    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            shown = {name: conn.execute(text(f"SHOW {name}")).scalar()
                     for name in ("fsync", "full_page_writes", "synchronous_commit",
                                  "wal_compression", "wal_buffers")}
    finally:
        engine.dispose()
    assert shown == {"fsync": "on", "full_page_writes": "on", "synchronous_commit": "off",
                     "wal_compression": "pglz", "wal_buffers": "16MB"}
