"""Broker down: writes answer 503 with Retry-After and leave nothing behind; reads go on.

Uses a broker of its own (Apache Kafka, KRaft) so stopping it does not disturb other tests.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from services.stack.brokers import ApacheKafka
from tests.conftest import isolated_settings
from tests.registry.artifacts import build_adapter
from tests.registry.conftest import (
    RunningRegistry,
    domain_events,
    publish,
    register_base,
    registry_settings,
)

pytestmark = pytest.mark.slow


def test_writes_503_while_broker_down_and_nothing_partial(own_broker: ApacheKafka,
                                                           tmp_path: Path) -> None:
    settings = registry_settings(isolated_settings(own_broker.bootstrap, None, topic_partitions=1),
                                 tmp_path / "blobs")
    running = RunningRegistry(settings).start()
    try:
        with running.client() as admin:
            register_base(admin)
            assert publish(admin, "bot", build_adapter(), "v1").status_code == 201
            own_broker.stop()
            started = time.monotonic()
            refused = publish(admin, "bot", build_adapter(seed=2), "v2")
            assert refused.status_code == 503, refused.text
            assert int(refused.headers["retry-after"]) >= 1
            assert time.monotonic() - started < 4 * settings.registry_write_timeout_s
            adapter = admin.get("/v1/adapters/bot")  # reads from memory
            assert adapter.status_code == 200 and adapter.json()["latest_version"] == 1
            assert admin.get("/v1/adapters/bot/versions/2").status_code == 404

            own_broker.start()
            deadline = time.monotonic() + 60
            while True:
                retried = publish(admin, "bot", build_adapter(seed=2), "v2")
                if retried.status_code != 503 or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert retried.status_code == 201, retried.text
            assert retried.json()["version"] == 2
    finally:
        running.stop()
    published = [e for e in domain_events(settings) if e.type == "AdapterVersionPublished"]
    assert [(e.payload.version, e.payload.label, e.seq) for e in published] == [
        (1, "v1", 1), (2, "v2", 2)]
