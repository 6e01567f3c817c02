"""A real router per test: `RouterApp` on loopback ports (gRPC and HTTP) in a thread of the
test process, folding the test's own Kafka topics, in front of stand-in workers
(`tests/router/standin.py`) that serve the same proto and send real heartbeats."""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from services.catalog.auth import token_hash
from services.catalog.state import adapter_stream, alias_stream, base_model_stream
from services.config import Settings
from services.contracts.events import (
    AdapterDisabled,
    AdapterRolledBack,
    AdapterVersionPublished,
    AdapterVersionSwitched,
    BaseModelRegistered,
    Envelope,
    Payload,
    SplitEntry,
    TenantRef,
    TrafficSplitChanged,
)
from services.contracts.grpc import inference_pb2 as pb
from services.contracts.grpc import inference_pb2_grpc as pb_grpc
from services.eventlog import EventProducer
from services.router.app import RouterApp
from services.stack.process import free_port
from tests.router.standin import BASE_DIGEST, ServerLoop, StandInWorker
from tests.waiting import wait_for

ACME = TenantRef(org="acme", team="search", project="prod")
RIVAL = TenantRef(org="rival", team="x", project="y")
TOKENS = {
    "acme": ("acme-token", {"role": "inference", "tenant": "acme/search/prod",
                            "qos_tier": "gold"}),
    "acme-any": ("acme-any-token", {"role": "inference", "tenant": "acme/*/*"}),
    "rival": ("rival-token", {"role": "inference", "tenant": "rival/x/y"}),
    "admin": ("admin-token", {"role": "admin"}),
    "reader": ("reader-token", {"role": "reader"}),
}


def auth_setting() -> str:
    return json.dumps([{"sha256": token_hash(tok), **spec} for tok, spec in TOKENS.values()])


def bearer(who: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[who][0]}"),)


def router_settings(settings: Settings, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "auth_tokens": auth_setting(), "heartbeat_interval_s": 0.2,
        "router_missed_heartbeats": 3, "router_burst_s": 10.0,
        "router_tenant_rate": {t: 10_000.0 for t in ("platinum", "gold", "silver", "bronze")},
        "router_adapter_rate": {t: 10_000.0 for t in ("platinum", "gold", "silver", "bronze")},
        "router_cold_load_rate": {t: 1_000.0 for t in ("platinum", "gold", "silver",
                                                       "bronze")},
        "log_level": "WARNING", **overrides}
    return settings.model_copy(update=values)


def sha_of(adapter_id: str, version: int) -> str:
    return hashlib.sha256(f"{adapter_id}@{version}".encode()).hexdigest()


class CatalogWriter:
    """Writes the registry's events straight to the test's adapter topic (validated by the
    same producer the registry uses), so a test states the catalog it needs in a line."""

    def __init__(self, settings: Settings) -> None:
        self.producer = EventProducer(settings, client_id="test-catalog")
        self.seqs: dict[str, int] = {}
        self.catalog: dict[tuple[str, int], str] = {}
        """(adapter_id, version) → sha256: what stand-in workers resolve pins with."""

    def _emit(self, payload: Payload, stream: str, tenant: TenantRef | None) -> None:
        self.seqs[stream] = self.seqs.get(stream, 0) + 1
        self.producer.publish(Envelope.new(payload, stream=stream, seq=self.seqs[stream],
                                           actor="test", tenant=tenant))

    def base(self, name: str = "tiny-llama", digest: str = BASE_DIGEST,
             config: dict[str, Any] | None = None) -> None:
        self._emit(BaseModelRegistered(name=name, digest=digest, config=config or {}),
                   base_model_stream(name), None)

    def publish(self, adapter_id: str, version: int = 1, *, tenant: TenantRef = ACME,
                tier: str = "silver", base: str = "tiny-llama", base_digest: str = BASE_DIGEST,
                activate: bool = True) -> str:
        sha = sha_of(adapter_id, version)
        self.catalog[(adapter_id, version)] = sha
        self._emit(AdapterVersionPublished(
            adapter_id=adapter_id, version=version, label=f"{adapter_id}-v{version}",
            base_model=base, base_model_digest=base_digest, sha256=sha, config_sha256="c" * 64,
            size_bytes=1000, rank=8, lora_alpha=16, target_modules=["q_proj"], dtype="float16",
            qos_tier=tier, owner="ops@test"), adapter_stream(adapter_id), tenant)  # type: ignore[arg-type]
        if activate:
            self._emit(AdapterVersionSwitched(adapter_id=adapter_id, from_version=None,
                                              to_version=version),
                       adapter_stream(adapter_id), tenant)
        return sha

    def split(self, alias: str, weights: dict[tuple[str, int], int], *,
              tenant: TenantRef = ACME) -> None:
        self._emit(TrafficSplitChanged(alias=alias, split=[
            SplitEntry(adapter_id=a, version=v, weight=w) for (a, v), w in weights.items()]),
            alias_stream(alias), tenant)

    def disable(self, adapter_id: str, version: int, *, tenant: TenantRef = ACME) -> None:
        self._emit(AdapterDisabled(adapter_id=adapter_id, version=version, reason="bad"),
                   adapter_stream(adapter_id), tenant)

    def rollback(self, adapter_id: str, frm: int, to: int, *, tenant: TenantRef = ACME) -> None:
        self._emit(AdapterRolledBack(adapter_id=adapter_id, from_version=frm, to_version=to,
                                     reason="regression"), adapter_stream(adapter_id), tenant)

    def close(self) -> None:
        self.producer.close()


class RunningRouter:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.app = RouterApp(settings, grpc_port=free_port(), http_port=free_port())
        self.listening = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.channel: grpc.Channel | None = None

    def _run(self) -> None:
        try:
            asyncio.run(self.app.run(on_listening=self.listening.set))
        except BaseException as exc:  # surfaced by start()
            self.error = exc
            self.listening.set()

    @property
    def dispatcher(self) -> Any:
        return self.app.dispatcher

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.app.http_port}"

    def start(self, timeout_s: float = 60.0) -> RunningRouter:
        self.thread.start()
        if not self.listening.wait(timeout_s) or self.error:
            raise RuntimeError(f"router did not start: {self.error}")
        wait_for(lambda: self.dispatcher.ready, timeout_s, message="router ready")
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.app.grpc_port}")
        return self

    def stub(self) -> pb_grpc.InferenceStub:
        assert self.channel is not None
        return pb_grpc.InferenceStub(self.channel)

    def wait_ring(self, members: set[str], timeout_s: float = 15.0) -> None:
        wait_for(lambda: set(self.dispatcher.ring.members) == members, timeout_s,
                 message=f"ring == {sorted(members)}")

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        self.app.stop()
        self.thread.join(timeout=30)


def request(alias: str | None = None, *, pinned: tuple[str, int] | None = None,
            user: str = "u1", tenant: TenantRef | None = ACME, text: str = "hello there",
            scope: str = "", max_tokens: int = 0) -> pb.GenerateRequest:
    sig = pb.TenantSignature(user_id=user, compliance_scope=scope)
    if tenant is not None:
        sig.org_id, sig.team_id, sig.project_id = tenant.org, tenant.team, tenant.project
    ref = pb.AdapterRef()
    if alias is not None:
        ref.alias = alias
    if pinned is not None:
        ref.pinned.adapter_id, ref.pinned.version = pinned
    return pb.GenerateRequest(tenant=sig, adapter=ref, text=text,
                              sampling=pb.SamplingParams(max_tokens=max_tokens))


def collect(stub: pb_grpc.InferenceStub, req: pb.GenerateRequest, who: str = "acme",
            timeout: float = 10.0) -> list[pb.GenerateResponse]:
    return list(stub.Generate(req, metadata=bearer(who), timeout=timeout))


@pytest.fixture
def server_loop() -> Iterator[ServerLoop]:
    loop = ServerLoop()
    yield loop
    loop.close()


@pytest.fixture
def rsettings(settings: Settings) -> Settings:
    return router_settings(settings)


@pytest.fixture
def catalog(rsettings: Settings) -> Iterator[CatalogWriter]:
    writer = CatalogWriter(rsettings)
    writer.base()
    yield writer
    writer.close()


class Fleet:
    """Stand-in workers of one test, started and closed together."""

    def __init__(self, settings: Settings, loop: ServerLoop, catalog: CatalogWriter) -> None:
        self.settings = settings
        self.loop = loop
        self.catalog = catalog
        self.workers: dict[str, StandInWorker] = {}

    def add(self, worker_id: str, **kwargs: Any) -> StandInWorker:
        worker = StandInWorker(self.settings, worker_id, self.loop,
                               catalog=self.catalog.catalog, **kwargs).start()
        self.workers[worker_id] = worker
        return worker

    def __getitem__(self, worker_id: str) -> StandInWorker:
        return self.workers[worker_id]

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()


@pytest.fixture
def fleet(rsettings: Settings, server_loop: ServerLoop, catalog: CatalogWriter
          ) -> Iterator[Fleet]:
    workers = Fleet(rsettings, server_loop, catalog)
    yield workers
    workers.close()


@pytest.fixture
def make_router(rsettings: Settings) -> Iterator[Callable[..., RunningRouter]]:
    started: list[RunningRouter] = []

    def make(**overrides: Any) -> RunningRouter:
        running = RunningRouter(rsettings.model_copy(update=overrides)).start()
        started.append(running)
        return running

    yield make
    for running in started:
        running.stop()
