"""A purge ends serving, checked from outside on real processes.

Apache Kafka, PostgreSQL (the audit store), the registry, a router PROCESS and two worker
PROCESSES on the tiny model. Tenant X (acme) and tenant Y (rival) stream through the
router; X is purged mid-stream. Then, for a window (`LORAPLANE_TEST_PURGE_WINDOW_S`, 9 s
here; the drill as specified runs it at 30), split in three phases around a kill -9 and
restart of the worker that served X and a kill -9 and restart of the router, both fronts
are probed with clients this project did not write: generated gRPC stubs and the official
`openai` package. X must get no served request and no blob download (counted from the
registry's blob route), Y must be served in every phase, and afterwards a version of X
published after the purge is served as usual, the proof says `met` with the blobs erased,
and the audit store has no answered X request dated after the purge.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from sqlalchemy import Engine, text

from services.audit.db import make_engine, upgrade
from services.audit.projector import AuditProjector
from services.config import Settings
from services.contracts.grpc import inference_pb2 as pb
from services.contracts.grpc import inference_pb2_grpc as pb_grpc
from services.stack.process import ChildProcess, free_port
from tests.conftest import REPO, drop_isolation, isolated_settings
from tests.router.conftest import TOKENS as ROUTER_TOKENS
from tests.router.conftest import auth_setting as router_auth
from tests.waiting import wait_for
from tests.worker.conftest import ServedModel
from tests.worker.harness import (
    BASE_NAME,
    Stack,
    fresh_adapter,
    publish_files,
    signature,
    switch,
    worker_env,
)

pytestmark = pytest.mark.slow

WINDOW_S = float(os.environ.get("LORAPLANE_TEST_PURGE_WINDOW_S", "9"))
"""How long the fronts are probed after the purge, in three phases (at least a third of it
each, restarts included). The drill as the issue states it is 30 s."""

X = {"org": "acme", "team": "search", "project": "prod"}
Y = {"org": "rival", "team": "x", "project": "y"}
PROMPT = [5, 6, 7, 8]
HIGH = json.dumps({t: 10_000.0 for t in ("platinum", "gold", "silver", "bronze")})


class BlobReads(logging.Handler):
    """What the registry's blob route hands out, per digest: (when, digest, outcome).

    `sent`: the route hashed the blob before sending it (`verify`, called by the route
    alone, wrapped here and still doing its work); `missing`: it was not in the store;
    `refused`: the route refused it without looking (its log line)."""

    LINE = re.compile(r"blob ([0-9a-f]{64}) refused to \S+: purged")

    def __init__(self, store: Any) -> None:
        super().__init__(logging.INFO)
        self.reads: list[tuple[float, str, str]] = []
        verify = store.verify

        def counted(digest: str) -> int:
            try:
                size: int = verify(digest)
            except Exception:
                self.reads.append((time.monotonic(), digest, "missing"))
                raise
            self.reads.append((time.monotonic(), digest, "sent"))
            return size

        store.verify = counted

    def emit(self, record: logging.LogRecord) -> None:
        found = self.LINE.match(record.getMessage())
        if found:
            self.reads.append((time.monotonic(), found.group(1), "refused"))

    def of(self, digests: set[str], since: float) -> Counter[str]:
        return Counter(outcome for at, digest, outcome in self.reads
                       if digest in digests and at >= since)


class RouterProcess:
    """`loraplane serve router` on fixed ports, so a restart comes back where it was."""

    def __init__(self, settings: Settings, root: Path) -> None:
        self.grpc_port, self.http_port = free_port(), free_port()
        self.log_path = root / "router.log"
        self.env = worker_env(
            settings, auth_tokens=router_auth(), router_port=self.grpc_port,
            router_http_port=self.http_port, heartbeat_interval_s=0.5,
            router_missed_heartbeats=3, router_burst_s=10.0, router_tenant_rate=HIGH,
            router_adapter_rate=HIGH, router_cold_load_rate=HIGH, log_level="INFO")
        self.child: ChildProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self) -> RouterProcess:
        self.child = ChildProcess("router", [sys.executable, "-m", "services.cli", "serve",
                                             "router"], self.log_path, env=self.env, cwd=REPO)
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.child is not None:
            self.child.stop(sig, timeout=30)

    def ring_size(self) -> float | None:
        try:
            if httpx.get(f"{self.url}/readyz", timeout=1).status_code != 200:
                return None
            for line in httpx.get(f"{self.url}/metrics", timeout=1).text.splitlines():
                if line.startswith("loraplane_router_ring_size "):
                    return float(line.split()[1])
        except httpx.HTTPError:
            return None
        return None

    def serving(self, workers: int) -> bool:
        assert self.child is not None and self.child.alive(), self.child and self.child.log_tail()
        return self.ring_size() == workers


@dataclass
class Site:
    stack: Stack
    router: RouterProcess
    projector: AuditProjector
    engine: Engine


@pytest.fixture(scope="module")
def site(kafka_bootstrap: str, database_url: str, served_model: ServedModel,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    settings = isolated_settings(kafka_bootstrap, database_url, audit_signing_key="55" * 32)
    assert settings.database_url
    upgrade(settings.database_url)
    root = tmp_path_factory.mktemp("purge-drill")
    stack = Stack(settings, root, served_model.path)
    router = RouterProcess(stack.settings, root)
    engine = make_engine(settings.database_url)
    projector = AuditProjector(stack.settings, engine)
    try:
        stack.register_base()
        for worker in ("w1", "w2"):
            stack.worker(worker).start()
        for worker in ("w1", "w2"):
            stack.workers[worker].wait_serving()
            stack.wait_live(worker)
        router.start()
        wait_for(lambda: router.serving(2), 90, interval_s=0.1,
                 message="the router serving with both workers")
        yield Site(stack, router, projector, engine)
    finally:
        router.kill(signal.SIGTERM)
        projector.close()
        engine.dispose()
        stack.close()
        drop_isolation(settings, database_url)


def metadata(who: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {ROUTER_TOKENS[who][0]}"),)


def grpc_request(tenant: dict[str, str], adapter: str, max_tokens: int,
                 request_id: str = "") -> pb.GenerateRequest:
    request = pb.GenerateRequest(tenant=signature(**tenant), adapter=pb.AdapterRef(alias=adapter),
                                 request_id=request_id,
                                 sampling=pb.SamplingParams(max_tokens=max_tokens,
                                                            ignore_eos=True))
    request.token_ids.ids.extend(PROMPT)
    return request


@dataclass
class Probe:
    """Requests sent through both fronts, by (tenant, front, phase) and outcome."""

    router: RouterProcess
    purge_id: str
    counts: Counter[tuple[str, str, str, str]] = field(default_factory=Counter)
    wrong: list[str] = field(default_factory=list)
    """X refusals that did not say NOT_FOUND / model_not_found naming the purge."""
    phase: str = "after purge"

    def once(self) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{self.router.grpc_port}") as channel:
            stub = pb_grpc.InferenceStub(channel)
            for who, tenant, adapter in (("acme", X, "x-bot"), ("rival", Y, "y-bot")):
                self._grpc(stub, who, tenant, adapter)
                self._openai(who, adapter)

    def _count(self, who: str, front: str, outcome: str) -> None:
        self.counts[("X" if who == "acme" else "Y", front, self.phase, outcome)] += 1

    def _grpc(self, stub: pb_grpc.InferenceStub, who: str, tenant: dict[str, str],
              adapter: str) -> None:
        try:
            answers = list(stub.Generate(grpc_request(tenant, adapter, 3), timeout=15,
                                         metadata=metadata(who)))
        except grpc.RpcError as exc:
            code, detail = exc.code(), exc.details() or ""
            if code == grpc.StatusCode.UNAVAILABLE:
                self._count(who, "grpc", "unavailable")
            elif code == grpc.StatusCode.NOT_FOUND and self.purge_id in detail:
                self._count(who, "grpc", "not_found")
            else:
                self._count(who, "grpc", "error")
                self.wrong.append(f"grpc {who}: {code.name} {detail}")
            return
        served = any(a.HasField("token") for a in answers)
        self._count(who, "grpc", "served" if served else "empty")

    def _openai(self, who: str, adapter: str) -> None:
        api = openai.OpenAI(api_key=ROUTER_TOKENS[who][0], base_url=f"{self.router.url}/v1",
                            max_retries=0, timeout=15)
        try:
            # ignore_eos as in the gRPC probe: a sampled end-of-sequence is not an empty answer
            done = api.completions.create(model=f"{BASE_NAME}:{adapter}", prompt="w5 w6 w7",
                                          max_tokens=3, extra_body={"ignore_eos": True})
        except openai.NotFoundError as exc:
            body = exc.body if isinstance(exc.body, dict) else {}
            if body.get("code") == "model_not_found" and self.purge_id in str(
                    body.get("message")):
                self._count(who, "openai", "not_found")
            else:
                self._count(who, "openai", "error")
                self.wrong.append(f"openai {who}: 404 {body}")
            return
        except (openai.APIConnectionError, openai.APITimeoutError,
                openai.InternalServerError) as exc:
            self._count(who, "openai", "unavailable")
            if getattr(exc, "status_code", 503) != 503:
                self.wrong.append(f"openai {who}: {exc}")
            return
        except openai.APIStatusError as exc:
            self._count(who, "openai", "error")
            self.wrong.append(f"openai {who}: {exc.status_code} {exc.body}")
            return
        served = bool(done.choices and done.usage and done.usage.completion_tokens == 3)
        self._count(who, "openai", "served" if served else "empty")

    def run_for(self, seconds: float) -> None:
        stop = time.monotonic() + seconds
        while time.monotonic() < stop:
            self.once()

    def total(self, tenant: str, outcome: str, phase: str | None = None,
              front: str | None = None) -> int:
        return sum(n for (t, f, p, o), n in self.counts.items()
                   if t == tenant and o == outcome and phase in (None, p)
                   and front in (None, f))


@dataclass
class Streams:
    """Back-to-back long streams of one tenant through the router, from a few threads, so
    one is in flight whenever the purge lands (the tiny model streams 1000 tokens in about
    a second). Each stream's (start, end, outcome, tokens) is kept."""

    who: str
    tenant: dict[str, str]
    adapter: str
    router: RouterProcess
    max_tokens: int
    ended: list[tuple[float, float, str, int]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self, parallel: int = 2) -> Streams:
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(parallel)]
        for thread in self.threads:
            thread.start()
        return self

    def _run(self) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{self.router.grpc_port}") as channel:
            stub = pb_grpc.InferenceStub(channel)
            while not self.stop.is_set():
                began, tokens, outcome = time.monotonic(), 0, "no final"
                try:
                    for answer in stub.Generate(grpc_request(self.tenant, self.adapter,
                                                             self.max_tokens),
                                                timeout=120, metadata=metadata(self.who)):
                        if answer.HasField("token"):
                            tokens += 1
                        else:
                            outcome = pb.FinishReason.Name(answer.final.finish_reason)
                except grpc.RpcError as exc:
                    outcome = exc.code().name
                self.ended.append((began, time.monotonic(), outcome, tokens))

    def finish(self) -> list[tuple[float, float, str, int]]:
        self.stop.set()
        for thread in self.threads:
            thread.join(120)
        return self.ended


def test_a_purge_ends_serving_on_every_path_across_restarts(site: Site) -> None:
    blob_log = BlobReads(site.stack.registry.app.state.blobs)
    registry_log = logging.getLogger("loraplane.registry")
    level = registry_log.level
    registry_log.setLevel(logging.INFO)
    registry_log.addHandler(blob_log)
    try:
        _drill(site, blob_log)
    finally:
        registry_log.removeHandler(blob_log)
        registry_log.setLevel(level)


def _drill(site: Site, blob_log: BlobReads) -> None:
    stack, router = site.stack, site.router
    with stack.publisher() as pub:
        x_v1 = publish_files(pub, "x-bot", fresh_adapter(81), "v1", X, qos_tier="gold")
        switch(pub, "x-bot", 1)
    with stack.registry.client("rival") as rival:
        publish_files(rival, "y-bot", fresh_adapter(82), "v1", Y, qos_tier="gold")
        switch(rival, "y-bot", 1)
    x_blobs = {x_v1["sha256"], x_v1["config_sha256"]}
    probe = Probe(router, purge_id="-")
    with grpc.insecure_channel(f"127.0.0.1:{router.grpc_port}") as channel:
        stub = pb_grpc.InferenceStub(channel)

        def warm(who: str, tenant: dict[str, str], adapter: str) -> pb.FinalUsage | None:
            try:  # served once: the router remembers it (pre-warming) and a worker holds it
                return list(stub.Generate(grpc_request(tenant, adapter, 2), timeout=30,
                                          metadata=metadata(who)))[-1].final
            except grpc.RpcError:
                return None

        x_home = wait_for(lambda: warm("acme", X, "x-bot"), 60, interval_s=0.1,
                          message="X served before the purge")
        wait_for(lambda: warm("rival", Y, "y-bot"), 60, interval_s=0.1,
                 message="Y served before the purge")
    assert x_home.served_adapter.version == 1

    # X and Y stream; X is purged mid-stream
    x_streams = Streams("acme", X, "x-bot", router, 1000).start()
    y_streams = Streams("rival", Y, "y-bot", router, 600).start()
    wait_for(lambda: x_streams.ended and y_streams.ended, 120, interval_s=0.1,
             message="both tenants streaming")
    purged_at = time.monotonic()
    purged_wall = datetime.now(UTC)
    with stack.registry.client("admin") as admin:
        answer = admin.post("/v1/tenants/acme/search/prod/purge", json={"deadline_s": 30})
        assert answer.status_code == 202, answer.text
        purge_id = answer.json()["purge_id"]
        assert sorted(answer.json()["expected_workers"]) == ["w1", "w2"]
    probe.purge_id = purge_id
    stack.tail.wait("TenantPurged", purge_id=purge_id, count=2, timeout_s=60)
    acked_at = time.monotonic()  # streams begun after the acks, both tenants', have ended
    wait_for(lambda: any(e[0] > acked_at for e in x_streams.ended)
             and any(e[0] > acked_at for e in y_streams.ended), 60, interval_s=0.05,
             message="a stream of each tenant begun after the acks")
    x_ended, y_ended = x_streams.finish(), y_streams.finish()
    cut = [e for e in x_ended if purged_at <= e[1] and e[2] in ("FINISH_REASON_ABORTED",
                                                                 "ABORTED", "UNAVAILABLE")]
    assert cut, f"no X stream was cut by the purge: {x_ended[-6:]}"
    assert all(e[2] == "NOT_FOUND" for e in x_ended if e[0] > acked_at), x_ended[-6:]
    assert all((e[2], e[3]) == ("FINISH_REASON_LENGTH", 600) for e in y_ended), y_ended
    assert any(e[0] < purged_at < e[1] for e in y_ended), "no Y stream spanned the purge"

    # the window: three phases, a worker restart and a router restart in between
    phase_s = WINDOW_S / 3
    window_started = time.monotonic()
    probe.run_for(phase_s)
    killed = stack.workers[x_home.worker_id]
    probe.phase = "worker restart"
    killed.kill()
    # the probe goes on while waiting: it is the load the purge is checked under
    wait_for(lambda: router.ring_size() == 1 or probe.once(), 30, interval_s=0,
             message="the router dropping the killed worker")
    killed.start()
    wait_for(lambda: (killed.health() == 1 and router.ring_size() == 2) or probe.once(), 120,
             interval_s=0, message="the killed worker back in the ring")
    probe.run_for(phase_s)
    probe.phase = "router restart"
    router.kill()
    router.start()
    wait_for(lambda: router.serving(2) or probe.once(), 120, interval_s=0,
             message="the restarted router serving")
    probe.run_for(phase_s)
    window_s = time.monotonic() - window_started

    x_reads = blob_log.of(x_blobs, purged_at)
    report = {"window_s": round(window_s, 1),
              "x_served": probe.total("X", "served"), "x_refused": probe.total("X", "not_found"),
              "x_blob_fetches": x_reads["sent"], "x_blob_requests": sum(x_reads.values()),
              "y_served": probe.total("Y", "served"),
              "y_unavailable": probe.total("Y", "unavailable"),
              "counts": {"/".join(k): n for k, n in sorted(probe.counts.items())}}
    print("purge probe:", json.dumps(report, indent=1))
    assert report["x_served"] == 0, report
    assert probe.total("X", "empty") == 0 and probe.total("Y", "empty") == 0, report
    assert report["x_blob_fetches"] == 0 and report["x_blob_requests"] == 0, report
    assert probe.wrong == [], probe.wrong
    for phase in ("after purge", "worker restart", "router restart"):
        for front in ("grpc", "openai"):
            assert probe.total("X", "not_found", phase, front) > 0, (phase, front, report)
            assert probe.total("Y", "served", phase, front) > 0, (phase, front, report)
    assert window_s >= WINDOW_S

    # the registry shows X's version purged, its proof met with the blobs erased
    with stack.registry.client("admin") as admin:
        version = admin.get("/v1/adapters/x-bot/versions/1").json()
        assert (version["purged"], version["purged_by"]) == (True, purge_id), version
        proof = admin.get(f"/v1/purges/{purge_id}").json()
    assert proof["status"] == "met" and proof["blobs_erased_at"] is not None, proof
    assert x_blobs <= set(proof["blobs_deleted"]), proof

    # a version of X published after the purge is served as usual, on both fronts
    with stack.publisher() as pub:
        x_v2 = publish_files(pub, "x-bot", fresh_adapter(83), "v2", X, qos_tier="gold")
        switch(pub, "x-bot", 2)
    probe.phase = "republished"
    wait_for(lambda: (probe.total("X", "served", "republished", "grpc") > 0
             and probe.total("X", "served", "republished", "openai") > 0) or probe.once(), 60,
             interval_s=0, message="X's new version served on both fronts")
    assert blob_log.of({x_v2["sha256"]}, purged_at)["sent"] > 0  # fetched like any version

    # the audit store: the proof is met, and no X request answered after the purge
    marker = uuid.uuid4().hex
    with grpc.insecure_channel(f"127.0.0.1:{router.grpc_port}") as channel:
        list(pb_grpc.InferenceStub(channel).Generate(grpc_request(Y, "y-bot", 2, marker),
                                                     timeout=30, metadata=metadata("rival")))

    def projected(sql: str, **params: object) -> list[dict]:
        site.projector.project_batch(timeout=0.2)
        with site.engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(text(sql), params)]

    wait_for(lambda: projected("SELECT 1 FROM served_by WHERE request_id = :r", r=marker), 60,
             interval_s=0.1, message="the projector caught up")
    wait_for(lambda: projected("SELECT 1 FROM purge_proofs WHERE purge_id = :p AND status = 'met' "
                               "AND blobs_erased_at IS NOT NULL", p=purge_id), 60,
             interval_s=0.1, message="purge_proofs met")
    served_after = projected("SELECT count(*) AS n FROM served_by WHERE adapter_id = 'x-bot' "
                             "AND version = 1 AND status = 'ok' AND started_at > :t",
                             t=purged_wall)
    assert served_after == [{"n": 0}], served_after
