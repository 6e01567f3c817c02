"""Real services for release tests: registry, a gate-running worker, traffic, controller.

- `GateWorker` is the gate part of a worker: it heartbeats on its base model's digest,
  folds the log and hands it to `services.worker.gate_runner.GateDuty`, which runs the
  gates assigned to it through the real engine with the regression set and adapter files
  fetched from the registry's blob store by digest, and writes `QualityGateCompleted` on
  worker-events.
- `Traffic` produces request traces as workers do: it folds the log, resolves each
  request with the serving rule (`resolve_reference`, sticky per user, so the split the
  registry wrote decides who gets which version) and writes `RequestServed` batches.
  Errors are injected per version: a fraction `rate` of the requests a version serves end
  with status `error`, spread evenly (deterministic, so stage verdicts are).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx

from services.catalog.auth import token_hash
from services.catalog.serving import resolve_reference
from services.catalog.state import CatalogState, Refusal
from services.config import Settings
from services.contracts.events import (
    Envelope,
    Payload,
    RequestServed,
    ServedRequest,
    TenantRef,
    WorkerHeartbeat,
)
from services.eventlog import EventConsumer, EventProducer
from services.worker.engine import Engine
from services.worker.gate_runner import GateDuty
from services.worker.pool.blobs import BlobMissing
from tests.registry.conftest import TOKENS

TENANT = TenantRef(org="acme", team="search", project="prod")
CANARY_TOKEN = "canary-token"


def auth_setting() -> str:
    entries = [{"sha256": token_hash(tok), **spec} for tok, spec in TOKENS.values()]
    entries.append({"sha256": token_hash(CANARY_TOKEN), "role": "canary"})
    return json.dumps(entries)


class Follower:
    """A thread folding both topics into a CatalogState, with a hook per event."""

    def __init__(self, settings: Settings, name: str) -> None:
        self.settings = settings
        self.name = name
        self.state = CatalogState(stale_after_s=settings.stale_lease_threshold_s)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.error: BaseException | None = None

    def start(self) -> Follower:
        self.thread.start()
        return self

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        if self.error is not None:
            raise self.error

    def on_idle(self) -> None:
        """Called after every poll."""

    def _run(self) -> None:
        try:
            with EventConsumer(self.settings, self.settings.topics,
                               reader_id=f"{self.name}-{uuid.uuid4().hex[:6]}") as consumer:
                while not self.stop.is_set():
                    records = consumer.poll(timeout=0.05)
                    with self.lock:
                        for record in records:
                            self.state.apply(record.envelope)
                    self.on_idle()
        except BaseException as exc:  # surfaced by close()
            self.error = exc


class WorkerStream:
    """Events on `worker/{id}` with gap-free seqs, written in order."""

    def __init__(self, settings: Settings, worker_id: str) -> None:
        self.worker_id = worker_id
        self.producer = EventProducer(settings, client_id=worker_id)
        self.seq = 0

    def emit(self, payload: Payload) -> None:
        self.seq += 1
        self.producer.publish(Envelope.new(payload, stream=f"worker/{self.worker_id}",
                                           seq=self.seq, actor=self.worker_id))

    def close(self) -> None:
        self.producer.close()


class GateWorker(Follower):
    def __init__(self, settings: Settings, engine: Engine, registry_url: str,
                 worker_id: str = "w1", heartbeat_s: float = 0.5) -> None:
        super().__init__(settings, f"gate-{worker_id}")
        self.engine = engine
        self.worker_id = worker_id
        self.heartbeat_s = heartbeat_s
        self.blobs = httpx.Client(base_url=registry_url, timeout=30,
                                  headers={"Authorization": f"Bearer {TOKENS['worker'][0]}"})
        self.stream = WorkerStream(settings, worker_id)
        self.duty = GateDuty(engine, worker_id, self.fetch, self.stream.emit)
        self.beating = True
        self._last_beat = 0.0

    def fetch(self, digest: str) -> bytes:
        response = self.blobs.get(f"/v1/blobs/sha256/{digest}")
        if response.status_code == 404:
            raise BlobMissing(digest)
        response.raise_for_status()
        return response.content

    def on_idle(self) -> None:
        if self.beating and time.monotonic() - self._last_beat >= self.heartbeat_s:
            self._last_beat = time.monotonic()
            self.stream.emit(WorkerHeartbeat(worker_id=self.worker_id, address="127.0.0.1:1",
                                             base_model="numbers",
                                             base_model_digest=self.engine.base_digest))
        with self.lock:
            due = self.duty.due(self.state)
        for gate in due:
            self.duty.run(gate)

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.stream.close()
            self.blobs.close()


class Traffic(Follower):
    """`rate_per_s` requests on `alias`; `errors[version]` of them fail; `latency_ms[v]`."""

    def __init__(self, settings: Settings, alias: str, *, rate_per_s: float = 200.0,
                 errors: dict[int, float] | None = None,
                 latency_ms: dict[int, float] | None = None) -> None:
        super().__init__(settings, f"traffic-{alias}")
        self.alias = alias
        self.rate_per_s = rate_per_s
        self.errors = errors or {}
        self.latency_ms = latency_ms or {}
        self.stream = WorkerStream(settings, f"w-traffic-{uuid.uuid4().hex[:4]}")
        self.served: dict[int, int] = {}
        self._users = 0
        self._last = time.monotonic()

    def on_idle(self) -> None:
        now = time.monotonic()
        count = int((now - self._last) * self.rate_per_s)
        if count < 1:
            return
        self._last = now
        finished = datetime.now(UTC)
        batch = []
        with self.lock:
            for _ in range(count):
                self._users += 1
                user = f"user-{self._users % 5000}"
                try:
                    choice = resolve_reference(self.state, TENANT, self.alias, user)
                except Refusal:
                    continue
                n = self.served.get(choice.version, 0)
                self.served[choice.version] = n + 1
                rate = self.errors.get(choice.version, 0.0)
                failed = int((n + 1) * rate) > int(n * rate)  # evenly spread
                latency = self.latency_ms.get(choice.version, 40.0)
                batch.append(ServedRequest(
                    request_id=uuid.uuid4().hex, trace_id=uuid.uuid4().hex, tenant=TENANT,
                    user_id=user, adapter_id=choice.adapter_id, version=choice.version,
                    adapter_sha256=choice.sha256, base_model_digest="0" * 64, prompt_tokens=4,
                    completion_tokens=8,
                    started_at=finished - timedelta(milliseconds=latency),
                    finished_at=finished, status="error" if failed else "ok"))
        if batch:
            self.stream.emit(RequestServed(worker_id=self.stream.worker_id, requests=batch))

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.stream.close()


ENV_FIELDS = ("kafka_bootstrap", "adapter_events_topic", "worker_events_topic", "liveness_topic",
              "dead_letter_topic", "topic_partitions", "registry_url", "canary_token",
              "canary_interval_s", "canary_settle_s", "canary_lookback_s",
              "stale_lease_threshold_s", "state_dir", "canary_id", "log_level",
              "canary_metrics_port")


def controller_process(settings: Settings, log_path: Path) -> subprocess.Popen[bytes]:
    """`loraplane serve canary` as its own process, configured only through LORAPLANE_*."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLANE_")}
    for name in ENV_FIELDS:
        value = getattr(settings, name)
        if value is not None:
            env[f"LORAPLANE_{name.upper()}"] = str(value)
    return subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "canary"],
                            env=env, stdout=log_path.open("wb"), stderr=subprocess.STDOUT,
                            cwd=Path(__file__).resolve().parents[2])
