"""`loraplane serve canary`: the canary controller process.

Its own process, not part of the router: routers are many (scaled for traffic, on the
request path) while rollout decisions want one decider whose crash or restart cannot
touch serving; it needs the request traces of every worker (worker-events), which no
single router sees; and it writes commands through the registry like any operator, so
it holds no more power than its `canary` token. Two controllers by mistake are harmless:
each step names the stage it starts from, and the registry refuses the second.

State: the shared fold of adapter-events (rollouts, plans, stage clocks) and a
`TraceBook` of RequestServed traces from worker-events. At start it replays the
adapter-events from the beginning and the worker-events from `canary_lookback_s` ago
(found by timestamp), to the end of every partition, so a restarted controller resumes every
rollout at the stage the log says, with the figures the traces give, and in-process
counters never matter. Every `canary_interval_s` it asks `next_steps` what to do and sends
each step to the registry with an Idempotency-Key naming (rollout, stage, step), so a
retried request never applies twice.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
from confluent_kafka import Consumer, KafkaException, TopicPartition

from services import tls
from services.catalog.canary import TraceBook
from services.catalog.state import CatalogState
from services.config import Settings
from services.contracts.events import RequestServed
from services.endpoints import registry_client
from services.eventlog import EventConsumer, Record
from services.eventlog.client import consumer_config
from services.release.controller import ControllerStep, next_steps
from services.release.metrics import CanaryMetrics

log = logging.getLogger("loraplane.canary")

REFUSED = (404, 409, 412, 422)


def trace_start_offsets(settings: Settings, since: datetime,
                        client_id: str) -> dict[tuple[str, int], int]:
    """Per worker-events partition, the first offset at or after `since` (by timestamp).

    Partitions with nothing that recent start at their end; a broker that cannot answer
    leaves the reader at the beginning (slower, same result)."""
    consumer = Consumer(consumer_config(settings, f"{client_id}-offsets"))
    try:
        topic = settings.worker_events_topic
        metadata = consumer.list_topics(topic, timeout=15)
        partitions = sorted(metadata.topics[topic].partitions)
        stamp = int(since.timestamp() * 1000)
        found = consumer.offsets_for_times([TopicPartition(topic, p, stamp) for p in partitions],
                                           timeout=15)
        offsets = {}
        for tp in found:
            if tp.offset >= 0:
                offsets[(topic, tp.partition)] = tp.offset
            else:
                _, high = consumer.get_watermark_offsets(TopicPartition(topic, tp.partition),
                                                         timeout=15)
                offsets[(topic, tp.partition)] = high
        return offsets
    except (KafkaException, KeyError) as exc:
        log.warning("cannot find trace offsets by time, reading from the beginning: %s", exc)
        return {}
    finally:
        consumer.close()


class CanaryController:
    def __init__(self, settings: Settings, *, controller_id: str | None = None,
                 clock: Callable[[], datetime] = lambda: datetime.now(UTC),
                 http: httpx.Client | None = None) -> None:
        self.settings = settings
        self.controller_id = (controller_id or settings.canary_id
                              or f"canary-{uuid.uuid4().hex[:12]}")
        self.clock = clock
        self.state = CatalogState(stale_after_s=settings.stale_lease_threshold_s)
        self.book = TraceBook(retention=timedelta(seconds=settings.canary_lookback_s))
        headers = {"Authorization": f"Bearer {settings.canary_token}"} \
            if settings.canary_token else {}
        self.http = http or registry_client(settings.registry_urls, headers=headers,
                                            timeout=10.0, verify=tls.client_ssl_context(settings))
        self.sent: set[tuple[str, int, str]] = set()
        self.decisions: list[tuple[ControllerStep, int]] = []
        """Every step sent and the registry's status code (for logs and tests)."""
        self._consumer: EventConsumer | None = None
        self.ready = threading.Event()
        self.metrics = CanaryMetrics()

    # --- the log -------------------------------------------------------------------------

    def fold(self, record: Record) -> None:
        envelope = record.envelope
        self.state.apply(envelope)
        if isinstance(envelope.payload, RequestServed):
            for request in envelope.payload.requests:
                self.book.add_request(request)

    def open(self, timeout_s: float = 60.0) -> int:
        """Replay to the end of the log; returns how many events were folded."""
        since = self.clock() - timedelta(seconds=self.settings.canary_lookback_s)
        offsets = trace_start_offsets(self.settings, since, self.controller_id)
        consumer = EventConsumer(self.settings, self.settings.topics,
                                 reader_id=self.controller_id, start_offsets=offsets)
        try:
            count = consumer.catch_up(self.fold, timeout_s=timeout_s)
        except BaseException:
            consumer.close()
            raise
        self._consumer = consumer
        self.ready.set()
        self.metrics.ready.set(1)
        running = [r for r in self.state.rollouts.values() if r.status == "running"]
        log.info("canary controller %s ready: %d events, %d traces kept, resuming %s",
                 self.controller_id, count, len(self.book),
                 ", ".join(f"{r.alias} at {r.weight}%" for r in running) or "no rollout")
        return count

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
        self.http.close()
        self.metrics.close()

    # --- deciding ------------------------------------------------------------------------

    def tick(self) -> list[ControllerStep]:
        now = self.clock()
        self.book.prune(now)
        decided = next_steps(self.state, self.book, now, self.settings.canary_settle_s)
        steps = [s for s in decided if s.key not in self.sent]
        self._count_judgements(decided, steps, now)
        for step in steps:
            self._send(step)
        return steps

    def _count_judgements(self, decided: list[ControllerStep], steps: list[ControllerStep],
                          now: datetime) -> None:
        """A running rollout without a step waits; a step already sent (its event not yet
        folded) is not judged again."""
        running = {a for a, r in self.state.rollouts.items() if r.status == "running"}
        self.metrics.running.set(len(running))
        if not running:
            return
        for step in steps:
            self.metrics.judgements.labels(step.kind).inc()
        waiting = len(running - {s.alias for s in decided})
        if waiting:
            self.metrics.judgements.labels("wait").inc(waiting)
        self.metrics.last_judgement.set(now.timestamp())

    def _send(self, step: ControllerStep) -> None:
        body: dict[str, Any] = {"rollout_id": step.rollout_id, "from_stage": step.from_stage,
                                "reason": step.reason[:2048]}
        if step.judgement is not None:
            body["judgement"] = step.judgement.model_dump(mode="json")
        key = f"canary-{step.rollout_id}-{step.from_stage}-{step.kind}"
        try:
            response = self.http.post(f"/v1/aliases/{step.alias}/rollout/{step.kind}", json=body,
                                      headers={"Idempotency-Key": key})
        except httpx.HTTPError as exc:
            self.metrics.registry_errors.labels("unreachable").inc()
            log.warning("registry unreachable, %s of %s retried next tick: %s", step.kind,
                        step.alias, exc)
            return
        self.decisions.append((step, response.status_code))
        if response.status_code == 200:
            self.sent.add(step.key)
            self.metrics.steps.labels(self._action(step)).inc()
            log.info("%s %s (rollout %s, from stage %d): %s", step.kind, step.alias,
                     step.rollout_id, step.from_stage, step.reason)
        elif response.status_code in REFUSED:
            self.metrics.registry_errors.labels("refused").inc()
            log.warning("registry refused %s of %s: %s", step.kind, step.alias,
                        response.text[:500])
        else:
            self.metrics.registry_errors.labels("failed").inc()
            log.warning("registry answered %d to %s of %s; retried next tick",
                        response.status_code, step.kind, step.alias)

    def _action(self, step: ControllerStep) -> str:
        """The rollout step the registry applied: an advance from the last stage completes."""
        if step.kind == "advance":
            rollout = self.state.rollouts.get(step.alias)
            final = rollout is not None and rollout.rollout_id == step.rollout_id \
                and step.from_stage == len(rollout.plan.stages) - 1
            return "completed" if final else "advanced"
        return {"rollback": "rolled_back", "halt": "halted"}[step.kind]

    # --- the loop --------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Open (retrying while the broker is away), then fold and decide until `stop`."""
        while self._consumer is None and not stop.is_set():
            try:
                self.open()
            except Exception as exc:
                log.warning("canary controller cannot replay the log yet: %s", exc)
                stop.wait(1.0)
        next_tick = time.monotonic()
        while not stop.is_set():
            assert self._consumer is not None
            try:
                for record in self._consumer.poll(timeout=0.1):
                    self.fold(record)
            except Exception as exc:
                log.warning("cannot read the log, deciding from what is folded: %s", exc)
                stop.wait(0.5)
            if time.monotonic() >= next_tick:
                try:
                    self.tick()
                except Exception:
                    log.exception("canary tick failed")
                next_tick = time.monotonic() + self.settings.canary_interval_s


def serve(settings: Settings) -> None:
    """`loraplane serve canary` in the foreground; SIGINT / SIGTERM stop it."""
    import signal

    logging.basicConfig(level=settings.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    controller = CanaryController(settings)
    port = controller.metrics.serve(settings.canary_metrics_port, settings.canary_metrics_host)
    log.info("canary controller metrics on http://%s:%d/metrics", settings.canary_metrics_host,
             port)
    try:
        controller.run(stop)
    finally:
        controller.close()
