"""Audit fixtures: a projector on the test's own topics and schema, and a drain helper."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, func, select
from typer.testing import CliRunner

from services.audit.projector import AuditProjector
from services.audit.tables import events
from services.cli import app
from services.config import Settings
from tests.waiting import wait_for

SIGNING_KEY = "11" * 32
KEK = "22" * 32


@pytest.fixture
def audit_settings(migrated_settings: Settings) -> Settings:
    """Small checkpoint interval so short tests get several signed checkpoints, and none
    on time (a slow run would otherwise sign sizes the tests do not expect)."""
    return migrated_settings.model_copy(update={"audit_checkpoint_every": 8,
                                                "audit_checkpoint_every_s": 0.0,
                                                "audit_signing_key": SIGNING_KEY,
                                                "audit_kek": KEK})


@pytest.fixture
def projector(audit_settings: Settings, db_engine: Engine) -> Iterator[AuditProjector]:
    value = AuditProjector(audit_settings, db_engine)
    yield value
    value.close()


@pytest.fixture
def filled_events() -> list:
    """The story and 200 busy-platform events."""
    from tests.audit.scenario import mixed, story

    return story() + list(mixed(200, seed=2))


@pytest.fixture
def filled(audit_settings: Settings, projector: AuditProjector, db_engine: Engine,
           filled_events: list) -> Engine:
    """`filled_events` projected: a store with every kind of row and a few signed
    checkpoints per partition."""
    from tests.audit.scenario import produce, recorded

    produce(audit_settings, filled_events)
    drain(projector, len(recorded(filled_events)))
    return db_engine


def count_events(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(events)).scalar_one())


def drain(projector: AuditProjector, expected: int, timeout_s: float = 60.0) -> None:
    """Project until `expected` events are stored, then on to the end of every topic (the
    liveness topic stores no events, so the count alone does not say it was read)."""
    def stored() -> int | None:
        if (count := count_events(projector.engine)) >= expected:
            return count
        projector.project_batch(timeout=0.2)
        return None

    wait_for(stored, timeout_s, interval_s=0, message=f"{expected} events projected")
    settle(projector, timeout_s)


def settle(projector: AuditProjector, timeout_s: float = 60.0) -> None:
    """Project until the projector's consumer has reached the end of every partition."""
    def caught_up() -> bool:
        projector.project_batch(timeout=0.2)
        return projector.consumer.caught_up

    wait_for(caught_up, timeout_s, interval_s=0, message=lambda: (
        f"the projector at the end of every partition; behind on {projector.consumer.behind}"))


def cli(settings: Settings, *args: str) -> tuple[int, str]:
    """`loraplane audit ARGS` as a user runs it, configured by environment variables."""
    env = {f"LORAPLANE_{k.upper()}": str(getattr(settings, k)) for k in (
        "database_url", "kafka_bootstrap", "adapter_events_topic", "worker_events_topic",
        "liveness_topic", "dead_letter_topic", "state_dir", "audit_signing_key", "audit_kek",
        "audit_origin", "topic_partitions")}
    result = CliRunner().invoke(app, ["audit", *args], env=env)
    return result.exit_code, result.output
