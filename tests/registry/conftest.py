"""A real registry per test: uvicorn on a loopback port, the test's own Kafka topics, its own
transactional id and blob directory. Nothing about Kafka is mocked."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from services.catalog.auth import token_hash
from services.config import Settings
from services.eventlog import EventConsumer
from services.registry.app import create_app
from services.registry.node import RegistryNode
from services.stack.brokers import ApacheKafka
from services.stack.process import free_port
from tests.registry.artifacts import LLAMA_CONFIG, LLAMA_DIGEST, AdapterFiles
from tests.waiting import wait_for

TOKENS = {
    "admin": ("admin-token", {"role": "admin"}),
    "publisher": ("publisher-token", {"role": "publisher", "tenant": "acme/search/prod"}),
    "rival": ("rival-token", {"role": "publisher", "tenant": "rival/x/y"}),
    "reader": ("reader-token", {"role": "reader"}),
    "worker": ("worker-token", {"role": "worker"}),
}
TENANT = {"org": "acme", "team": "search", "project": "prod"}


def auth_setting() -> str:
    return json.dumps([{"sha256": token_hash(tok), **spec} for tok, spec in TOKENS.values()])


def registry_settings(settings: Settings, blob_dir: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "auth_tokens": auth_setting(), "blob_dir": blob_dir,
        "registry_transactional_id": f"registry-{uuid.uuid4().hex[:8]}",
        "lease_interval_s": 1.0, "lease_ttl_s": 3.0, "registry_write_timeout_s": 3.0,
        "max_upload_bytes": 256 * 1024,
        # Tests of other parts publish without regression sets and switch at once;
        # tests/release runs the release rule with its default (block).
        "release_ungated": "allow", **overrides}
    return settings.model_copy(update=values)


class RunningRegistry:
    """One registry app under a real uvicorn server, in a thread of the test process."""

    def __init__(self, settings: Settings, registry_id: str | None = None) -> None:
        self.settings = settings
        self.app = create_app(settings, registry_id=registry_id)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def node(self) -> RegistryNode:
        node: RegistryNode = self.app.state.node
        return node

    def start(self, wait_ready: bool = True, timeout_s: float = 60.0) -> RunningRegistry:
        self.thread.start()
        started = time.monotonic()
        wait_for(lambda: self.server.started or not self.thread.is_alive(), timeout_s,
                 interval_s=0.02, message="the registry server to start")
        if not self.server.started:
            raise RuntimeError("registry server did not start")
        left = timeout_s - (time.monotonic() - started)
        if wait_ready and not self.node.ready.wait(max(0.0, left)):
            raise RuntimeError(f"registry not ready: {self.node.last_error}")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def client(self, who: str | None = "admin", **kwargs: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {TOKENS[who][0]}"} if who else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30, **kwargs)


@pytest.fixture
def own_broker(tmp_path: Path, settings: Settings) -> Iterator[ApacheKafka]:
    """A one-partition Apache Kafka of the test's own, to stop or pause without
    disturbing other tests."""
    broker = ApacheKafka(settings.model_copy(update={"topic_partitions": 1}), tmp_path / "kafka")
    broker.start()
    yield broker
    broker.stop()


@pytest.fixture
def reg_settings(settings: Settings, tmp_path: Path) -> Settings:
    return registry_settings(settings, tmp_path / "blobs")


@pytest.fixture
def registry(reg_settings: Settings) -> Iterator[RunningRegistry]:
    running = RunningRegistry(reg_settings).start()
    yield running
    running.stop()


def register_base(client: httpx.Client, name: str = "tiny-llama") -> httpx.Response:
    response = client.post("/v1/base-models", json={
        "name": name, "digest": LLAMA_DIGEST, "config": LLAMA_CONFIG})
    assert response.status_code == 201, response.text
    return response


def publish(client: httpx.Client, adapter_id: str, files: AdapterFiles, label: str,
            headers: dict[str, str] | None = None, **form: Any) -> httpx.Response:
    data = {**TENANT, "owner": "alice@acme", "base_model": "tiny-llama", "label": label, **form}
    return client.post(f"/v1/adapters/{adapter_id}/versions", data=data, headers=headers or {},
                       files={"adapter_config": ("adapter_config.json", files.config),
                              "adapter_model": ("adapter_model.safetensors", files.weights)})


def log_events(settings: Settings, topic: str | None = None) -> list[Any]:
    """Every committed event on the adapter topic (barriers excluded), via a fresh reader."""
    seen: list[Any] = []
    with EventConsumer(settings, [topic or settings.adapter_events_topic],
                       reader_id=f"test-reader-{uuid.uuid4().hex[:6]}") as consumer:
        consumer.catch_up(lambda r: seen.append(r.envelope))
    return seen


def domain_events(settings: Settings) -> list[Any]:
    return [e for e in log_events(settings) if e.type != "RegistryLease"]
