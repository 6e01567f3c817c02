"""Database engine and migrations, shared by the projector, the CLI and the tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


def make_engine(url: str, **kwargs: object) -> Engine:
    return create_engine(url, pool_pre_ping=True, **kwargs)  # type: ignore[arg-type]


def alembic_config(url: str) -> Config:
    config = Config(str(MIGRATIONS_DIR / "alembic.ini"))
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["url"] = url
    config.attributes["configure_logger"] = False
    return config


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(url), revision)


def revision_module(revision: str) -> Any:
    """An earlier revision's module, while a migration runs: a revision that rebuilds a
    view an earlier one defined takes its definition from there instead of a copy."""
    from alembic import context

    script = ScriptDirectory.from_config(context.config).get_revision(revision)
    if script is None or script.module is None:
        raise LookupError(f"no Alembic revision {revision}")
    return script.module
