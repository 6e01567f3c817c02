"""The worker's events thread on real Kafka: a request's trace is in the log before the
future its final message waits on is set, traces that finish together share an event
(group commit), and nothing is acknowledged while the broker is away."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import Future, wait
from datetime import UTC, datetime

import pytest

from services.config import Settings
from services.contracts.events import RequestServed, ServedRequest, TenantRef
from services.eventlog import BrokerUnavailable, EventConsumer, EventProducer
from services.worker.events import WorkerEvents
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

TENANT = TenantRef(org="acme", team="search", project="prod")


def served(request_id: str) -> ServedRequest:
    now = datetime.now(UTC)
    return ServedRequest(request_id=request_id, trace_id=uuid.uuid4().hex, tenant=TENANT,
                         adapter_id=None, version=None, adapter_sha256=None,
                         base_model_digest="b" * 64, prompt_tokens=3, completion_tokens=5,
                         started_at=now, finished_at=now)


def logged_traces(settings: Settings) -> list[tuple[int, list[str]]]:
    """(seq, request ids) of every RequestServed in the worker-events topic, to its end."""
    found: list[tuple[int, list[str]]] = []
    consumer = EventConsumer(settings, [settings.worker_events_topic],
                             reader_id=f"check-{uuid.uuid4().hex[:6]}")
    try:
        def keep(record: object) -> None:
            envelope = record.envelope  # type: ignore[attr-defined]
            if isinstance(envelope.payload, RequestServed):
                found.append((envelope.seq, [r.request_id for r in envelope.payload.requests]))
        consumer.catch_up(keep, timeout_s=30)
    finally:
        consumer.close()
    return sorted(found)


def test_traces_are_in_the_log_when_their_futures_are_set(settings: Settings) -> None:
    events = WorkerEvents(settings.model_copy(update={"worker_trace_flush_s": 60.0}), "w1",
                          heartbeat=lambda: None)
    events.start({})
    try:
        futures: dict[str, Future[None]] = {}

        def finish(name: str) -> None:
            for i in range(25):
                future = events.trace(served(f"{name}-{i}"))
                assert future is not None
                futures[f"{name}-{i}"] = future

        threads = [threading.Thread(target=finish, args=(f"t{n}",)) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        pending = wait(list(futures.values()), timeout=30).not_done
        assert not pending, f"{len(pending)} traces never acknowledged"
        # nothing waits for the flush interval (60 s here): each is written when it comes
        logged = logged_traces(settings)
        assert sorted(r for _, ids in logged for r in ids) == sorted(futures)
        assert [seq for seq, _ in logged] == list(range(1, len(logged) + 1))
        assert len(logged) < len(futures), "traces finishing together share an event"
    finally:
        events.stop()


def test_no_trace_is_acknowledged_while_the_broker_is_away(settings: Settings) -> None:
    away = threading.Event()
    away.set()

    tries: list[float] = []

    def producer() -> EventProducer:
        tries.append(time.monotonic())
        if away.is_set():
            raise BrokerUnavailable("the broker is away (test)")
        return EventProducer(settings, client_id="w1-events")

    events = WorkerEvents(settings, "w1", heartbeat=lambda: None, producer_factory=producer)
    events.start({})
    try:
        future = events.trace(served("held"))
        assert future is not None
        before = len(tries)  # two more failed tries at the broker, the trace among them
        wait_for(lambda: len(tries) >= before + 2, 30, message="two more tries at the broker")
        assert not future.done(), "acknowledged without a broker"
        away.clear()
        future.result(timeout=30)
        assert [ids for _, ids in logged_traces(settings)] == [["held"]]
    finally:
        events.stop()


def test_batched_traces_when_durability_is_off(settings: Settings) -> None:
    events = WorkerEvents(settings.model_copy(update={"worker_trace_durable": False,
                                                      "worker_trace_flush_s": 0.2}),
                          "w1", heartbeat=lambda: None)
    events.start({})
    try:
        assert events.trace(served("a")) is None and events.trace(served("b")) is None
        wait_for(lambda: not events.unsent, 30, message="the batch sent")
        assert [ids for _, ids in logged_traces(settings)] == [["a", "b"]]
    finally:
        events.stop()


def test_unsent_counts_a_batch_while_it_is_numbered(settings: Settings,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch leaves the outbox and is numbered in one hold of the lock: `unsent`, read
    by another thread meanwhile (the metrics, a test waiting for the log), never says 0
    with the batch not yet written. It said 0 between the two, and a reader went to the
    log before the batch was there."""
    from services.worker import events as events_module

    seen: list[int] = []
    real = events_module.Envelope.new

    def numbered(*args: object, **kwargs: object) -> object:
        if not seen and isinstance(args[0], RequestServed):
            reader = threading.Thread(target=lambda: seen.append(events.unsent))
            reader.start()
            reader.join(timeout=0.5)  # blocks on the lock until the batch is numbered
        return real(*args, **kwargs)

    monkeypatch.setattr(events_module.Envelope, "new", numbered)
    events = WorkerEvents(settings.model_copy(update={"worker_trace_durable": False,
                                                      "worker_trace_flush_s": 0.2}),
                          "w1", heartbeat=lambda: None)
    events.start({})
    try:
        assert events.trace(served("a")) is None
        wait_for(lambda: bool(seen) and not events.unsent, 30, message="the batch sent")
        assert seen[0] > 0
        assert [ids for _, ids in logged_traces(settings)] == [["a"]]
    finally:
        events.stop()
