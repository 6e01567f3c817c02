"""Event streams for the audit tests, the docs example and `bench/audit.py`.

`story()` is a small, readable history (adapters published, switched, split, rolled
back, disabled; workers loading and serving; purges met, missed and pending) whose
projection the compliance views are checked against. `mixed(n)` is a bulk stream with
the proportions of a busy platform: mostly request traces and heartbeats.
"""

from __future__ import annotations

import hashlib
import random
from collections import defaultdict
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

from services.config import Settings
from services.contracts.events import (
    LIVENESS_TOPIC,
    AdapterDisabled,
    AdapterLoaded,
    AdapterRolledBack,
    AdapterUnloaded,
    AdapterVersionPublished,
    AdapterVersionSwitched,
    Envelope,
    KVInvalidated,
    LoadedAdapter,
    Payload,
    RequestServed,
    ServedRequest,
    SplitEntry,
    TenantBlobsDeleted,
    TenantPurged,
    TenantPurgeRequested,
    TenantRef,
    TrafficSplitChanged,
    WorkerHeartbeat,
)
from services.eventlog import EventProducer

ACME = TenantRef(org="acme", team="ml", project="support")
GLOBEX = TenantRef(org="globex", team="apps", project="chat")
INITECH = TenantRef(org="initech", team="ops", project="batch")
BASE_DIGEST = hashlib.sha256(b"tiny-llama").hexdigest()


def digest(*parts: object) -> str:
    return hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()


class Log:
    """Builds envelopes with gap-free per-stream seqs and a controllable clock."""

    def __init__(self, start: datetime) -> None:
        self.now = start
        self.seqs: dict[str, int] = defaultdict(int)
        self.events: list[Envelope] = []

    def tick(self, seconds: float = 1.0) -> datetime:
        self.now += timedelta(seconds=seconds)
        return self.now

    def add(self, payload: Payload, stream: str, actor: str,
            tenant: TenantRef | None = None) -> Envelope:
        self.seqs[stream] += 1
        envelope = Envelope.new(payload, stream=stream, seq=self.seqs[stream], actor=actor,
                                tenant=tenant, occurred_at=self.now,
                                trace_id=digest("trace", stream, self.seqs[stream])[:32])
        self.events.append(envelope)
        return envelope

    # --- registry side -------------------------------------------------------------------

    def publish(self, adapter: str, version: int, tenant: TenantRef, actor: str,
                rollback_to: int | None = None, owner: str | None = None) -> Envelope:
        return self.add(AdapterVersionPublished(
            adapter_id=adapter, version=version, label=f"{adapter}-v{version}",
            base_model="tiny-llama", base_model_digest=BASE_DIGEST,
            sha256=digest(adapter, version), config_sha256=digest(adapter, version, "config"),
            size_bytes=4096 * version, rank=8, lora_alpha=16.0, target_modules=["q_proj"],
            dtype="float16", owner=owner or actor, rollback_to=rollback_to),
            f"adapter/{adapter}", actor, tenant)

    def switch(self, adapter: str, from_v: int | None, to_v: int, tenant: TenantRef,
               actor: str) -> Envelope:
        return self.add(AdapterVersionSwitched(adapter_id=adapter, from_version=from_v,
                                               to_version=to_v),
                        f"adapter/{adapter}", actor, tenant)

    def split(self, alias: str, adapter: str, weights: dict[int, int], tenant: TenantRef,
              actor: str) -> Envelope:
        return self.add(TrafficSplitChanged(alias=alias, split=[
            SplitEntry(adapter_id=adapter, version=v, weight=w) for v, w in weights.items()]),
            f"alias/{alias}", actor, tenant)

    # --- worker side ----------------------------------------------------------------------

    def heartbeat(self, worker: str, loaded: list[tuple[str, int]]) -> Envelope:
        return self.add(WorkerHeartbeat(
            worker_id=worker, address=f"{worker}:8781", base_model="tiny-llama",
            base_model_digest=BASE_DIGEST, free_slots=max(0, 8 - len(loaded)), free_kv_blocks=1000,
            loaded=[LoadedAdapter(adapter_id=a, version=v, sha256=digest(a, v))
                    for a, v in loaded]), f"worker/{worker}", worker)

    def loaded(self, worker: str, adapter: str, version: int) -> Envelope:
        return self.add(AdapterLoaded(worker_id=worker, adapter_id=adapter, version=version,
                                      sha256=digest(adapter, version), load_ms=12.5),
                        f"worker/{worker}", worker)

    def served(self, worker: str, adapter: str | None, version: int | None,
               tenant: TenantRef, requests: int, prefix: str, user: str | None = None,
               *, router: str | None = None, first: int = 0) -> Envelope:
        """Traces of requests `prefix-first` .. `prefix-(requests-1)` served by `worker`;
        written by the worker, or (`router`) by a router that saw them cut mid-stream."""
        start = self.now - timedelta(milliseconds=300)
        payload = RequestServed(worker_id=worker, witness="router" if router else "worker",
                                requests=[ServedRequest(
            request_id=f"{prefix}-{i}", trace_id=digest(prefix, i)[:32], tenant=tenant,
            user_id=user or f"user-{i % 3}", adapter_id=adapter, version=version,
            adapter_sha256=digest(adapter, version) if adapter else None,
            base_model_digest=BASE_DIGEST, prompt_tokens=0 if router else 20 + i,
            completion_tokens=(3 if router else 40) + i,
            started_at=start + timedelta(milliseconds=10 * i), finished_at=self.now,
            status="cut" if router else "ok")
            for i in range(first, requests)])
        if router:
            return self.add(payload, f"router/{router}", router)
        return self.add(payload, f"worker/{worker}", worker)


def story(now: datetime | None = None) -> list[Envelope]:
    """A small history with one of everything the compliance views report on."""
    now = now or datetime.now(UTC)
    log = Log(now - timedelta(hours=2))
    ops = "ops@acme"
    for v in (1, 2, 3):
        log.tick()
        log.publish("acme-support", v, ACME, ops, rollback_to=1 if v == 3 else None)
    log.tick()
    log.switch("acme-support", None, 1, ACME, ops)
    log.tick()
    log.heartbeat("w1", [("acme-support", 1)])
    log.heartbeat("w2", [])
    log.tick()
    log.loaded("w2", "acme-support", 1)
    log.served("w1", "acme-support", 1, ACME, 2, "req-a")
    log.tick(60)
    log.switch("acme-support", 1, 2, ACME, ops)
    log.tick()
    log.split("support", "acme-support", {2: 90, 3: 10}, ACME, ops)
    log.tick()
    log.loaded("w1", "acme-support", 3)
    log.served("w1", "acme-support", 3, ACME, 1, "req-b")
    log.tick(60)
    log.split("support", "acme-support", {3: 100}, ACME, ops)
    log.tick()
    log.switch("acme-support", 2, 3, ACME, ops)
    log.tick(60)
    log.add(AdapterRolledBack(adapter_id="acme-support", from_version=3, to_version=2,
                              reason="quality regression on eval set"),
            "adapter/acme-support", "oncall@acme", ACME)
    log.tick()
    log.split("support", "acme-support", {2: 100}, ACME, "oncall@acme")
    log.tick()
    log.add(AdapterDisabled(adapter_id="acme-support", version=3, reason="bad eval"),
            "adapter/acme-support", "oncall@acme", ACME)
    log.add(AdapterUnloaded(worker_id="w1", adapter_id="acme-support", version=3,
                            sha256=digest("acme-support", 3), reason="disabled"),
            "worker/w1", "w1")
    log.add(KVInvalidated(worker_id="w1", reason="disable",
                          adapter_sha256=digest("acme-support", 3), blocks_freed=42),
            "worker/w1", "w1")
    # globex: v1 then v2 active, v1 disabled afterwards: no rollback candidate
    for v in (1, 2):
        log.tick()
        log.publish("globex-chat", v, GLOBEX, "dev@globex")
        log.switch("globex-chat", v - 1 or None, v, GLOBEX, "dev@globex")
    log.add(AdapterDisabled(adapter_id="globex-chat", version=1, reason="license"),
            "adapter/globex-chat", "dev@globex", GLOBEX)
    log.tick()
    log.loaded("w2", "globex-chat", 2)
    log.served("w2", "globex-chat", 2, GLOBEX, 2, "req-c")
    # purge 1: w1 and w2 live (the registry lists them in the request), both ack in time -> met
    log.tick(5)
    log.heartbeat("w1", [("acme-support", 2)])
    log.heartbeat("w2", [("globex-chat", 2)])
    log.tick(5)
    log.add(TenantPurgeRequested(purge_id="purge-met", deadline_s=60,
                                 expected_workers=["w1", "w2"]),
            "tenant/globex/apps/chat", "privacy@globex", GLOBEX)
    log.tick(3)
    log.add(TenantBlobsDeleted(purge_id="purge-met", deleted=sorted(
        d for v in (1, 2) for d in (digest("globex-chat", v),
                                    digest("globex-chat", v, "config")))),
        "tenant/globex/apps/chat", "registry/erasure", GLOBEX)
    for w, blocks in (("w1", 0), ("w2", 17)):
        log.add(TenantPurged(worker_id=w, purge_id="purge-met", kv_blocks_freed=blocks,
                             adapters_unloaded=1 if w == "w2" else 0, refcounts_zero=True),
                f"worker/{w}", w)
    # purge 2: w3 joins, is live and never acks -> missed
    log.tick(600)
    log.heartbeat("w3", [])
    log.heartbeat("w1", [("acme-support", 2)])
    log.tick(2)
    log.add(TenantPurgeRequested(purge_id="purge-missed", deadline_s=30,
                                 expected_workers=["w1", "w3"]),
            "tenant/initech/ops/batch", "privacy@initech", INITECH)
    log.tick(1)
    log.add(TenantPurged(worker_id="w1", purge_id="purge-missed", kv_blocks_freed=5,
                         adapters_unloaded=1, refcounts_zero=True), "worker/w1", "w1")
    # purge 3: requested just now with an hour to go, nobody acked yet -> pending
    log.now = now - timedelta(seconds=20)
    log.heartbeat("w2", [("globex-chat", 2)])
    log.now = now - timedelta(seconds=10)
    log.add(TenantPurgeRequested(purge_id="purge-pending", deadline_s=3600,
                                 expected_workers=["w2"]),
            "tenant/globex/apps/chat", "privacy@globex", GLOBEX)
    return log.events


def mixed(n: int, *, seed: int = 7, workers: int = 8, adapters: int = 24) -> Iterator[Envelope]:
    """`n` events with a busy platform's mix: ~55% traces (4 requests each), ~30%
    heartbeats, ~10% load/unload/KV acks, ~5% registry lifecycle events."""
    rng = random.Random(seed)
    log = Log(datetime.now(UTC) - timedelta(days=1))
    tenants = [TenantRef(org=f"org{i}", team="team", project="proj") for i in range(6)]
    names = [f"adapter-{i}" for i in range(adapters)]
    latest = dict.fromkeys(names, 0)
    active: dict[str, int | None] = dict.fromkeys(names, None)
    held: dict[str, set[tuple[str, int]]] = {f"w{i}": set() for i in range(workers)}
    produced = 0
    while produced < n:
        log.tick(0.01)
        roll = rng.random()
        worker = f"w{rng.randrange(workers)}"
        name = rng.choice(names)
        tenant = tenants[names.index(name) % len(tenants)]
        if roll < 0.05 or latest[name] == 0:
            if latest[name] == 0 or rng.random() < 0.5:
                latest[name] += 1
                log.publish(name, latest[name], tenant, "ops")
            else:
                log.switch(name, active[name], latest[name], tenant, "ops")
                active[name] = latest[name]
        elif roll < 0.15:
            version = latest[name]
            if (name, version) in held[worker] and rng.random() < 0.5:
                held[worker].discard((name, version))
                log.add(AdapterUnloaded(worker_id=worker, adapter_id=name, version=version,
                                        sha256=digest(name, version), reason="evicted"),
                        f"worker/{worker}", worker)
            elif rng.random() < 0.5:
                held[worker].add((name, version))
                log.loaded(worker, name, version)
            else:
                log.add(KVInvalidated(worker_id=worker, reason="switch", blocks_freed=3,
                                      adapter_sha256=digest(name, version)),
                        f"worker/{worker}", worker)
        elif roll < 0.45:
            log.heartbeat(worker, sorted(held[worker]))
        else:
            log.served(worker, name, latest[name], tenant, 4, f"r{produced}")
        produced += 1
        yield log.events.pop()


def recorded(envelopes: list[Envelope]) -> list[Envelope]:
    """The events the audit store keeps one by one: all but liveness (leases, heartbeats)."""
    return [e for e in envelopes if type(e.payload).topic != LIVENESS_TOPIC]


def produce(settings: Settings, envelopes: list[Envelope] | Iterator[Envelope],
            chunk: int = 2000) -> int:
    """Publish in chunks with one idempotent producer; returns the count."""
    count = 0
    batch: list[tuple[Envelope, None, None]] = []
    with EventProducer(settings, client_id="audit-test-producer") as producer:
        for envelope in envelopes:
            batch.append((envelope, None, None))
            if len(batch) >= chunk:
                producer.publish_all(batch)
                count += len(batch)
                batch = []
        if batch:
            producer.publish_all(batch)
            count += len(batch)
    return count
