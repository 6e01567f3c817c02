"""The one producer wrapper: validates every event, then writes it idempotently or in a
transaction of its own.

Transactional mode is for the registry, the single writer of `adapter-events`: a fixed
`transactional.id` means a second instance's `init_transactions` fences the first, whose
next write raises `ProducerFenced` instead of corrupting the log. One command is one
transaction, so no reader ever depends on `read_committed` to hide a half-done command.

A transactional producer is initialised once. After a failed write it settles the
transaction and goes on with the same producer: a commit that timed out is resumed (its
outcome was unknown: it may well commit), anything else is aborted; if the broker does
not answer, that happens before the next write (`recover`). Re-initialising the
`transactional.id` after a transient error would fence whichever instance holds it now, so
a zombie that had already lost the writer role would take the log back. Once fenced it
refuses every write for good.

One case does need a new client: librdkafka makes some broker answers fatal that are not
fencing. The usual one follows a broker restart: the coordinator never registered the
transaction's partitions, so the abort is refused with INVALID_TXN_STATE. The coordinator
checks the producer epoch before the state, so such an answer also proves that nobody
has initialised the id since. When settling a failed write gets it, a new client
initialises the id at once and the write waiting on that settlement goes on; when a write
itself gets it, that write fails (`ProducerLost`) and the next one starts the new client.
An instance fenced in the short gap between that answer and the new initialisation would
fence its successor back; the registry then sees the successor's lease in the log and
turns read-only too, so the log never has two writers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from services.config import Settings
from services.contracts.codec import encode
from services.contracts.events import Envelope
from services.eventlog.client import producer_config
from services.eventlog.errors import (
    BrokerUnavailable,
    EventLogError,
    ProducerFenced,
    ProducerLost,
)
from services.eventlog.topics import topic_for

_FENCED = {
    KafkaError._FENCED,
    KafkaError.PRODUCER_FENCED,
    KafkaError.INVALID_PRODUCER_EPOCH,
    KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
}
_UNAVAILABLE = {
    KafkaError._TIMED_OUT,
    KafkaError._MSG_TIMED_OUT,
    KafkaError._TRANSPORT,
    KafkaError._ALL_BROKERS_DOWN,
    KafkaError._RESOLVE,
    KafkaError.REQUEST_TIMED_OUT,
    KafkaError.NOT_COORDINATOR,
    KafkaError.COORDINATOR_NOT_AVAILABLE,
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
}


@dataclass(frozen=True)
class RecordPosition:
    topic: str
    partition: int
    offset: int


EventOrDocument = Envelope | Mapping[str, Any]


def _classify(error: KafkaError | None, context: str) -> EventLogError:
    if error is not None and error.code() in _FENCED:
        return ProducerFenced(f"{context}: {error.str()}")
    if error is not None and error.fatal():
        return ProducerLost(f"{context}: {error.str()}")
    if error is not None and error.code() in _UNAVAILABLE:
        return BrokerUnavailable(f"{context}: {error.str()}")
    return EventLogError(f"{context}: {error.str() if error else 'unknown error'}")


class EventProducer:
    """Writes validated events; `transactional_id=None` gives an idempotent producer."""

    def __init__(
        self,
        settings: Settings,
        *,
        transactional_id: str | None = None,
        client_id: str = "loraplane-producer",
        timeout_s: float = 10.0,
        **overrides: Any,
    ) -> None:
        self.settings = settings
        self.transactional_id = transactional_id
        self.timeout_s = timeout_s
        extra: dict[str, Any] = dict(overrides)
        if transactional_id:
            extra.setdefault("transactional.id", transactional_id)
            extra.setdefault("transaction.timeout.ms", 60000)
        self._config = producer_config(settings, client_id, **extra)
        self._producer = Producer(self._config)
        self._lock = threading.Lock()
        self._fenced = False
        self._lost = False
        """The client hit a fatal error that is not fencing: replace it before the next write."""
        self._unsettled: Literal["commit", "abort"] | None = None
        """A transaction a failed write left open, and how to settle it."""
        self._init_transactions(timeout_s)

    def _init_transactions(self, timeout_s: float) -> None:
        if self.transactional_id:
            try:
                self._producer.init_transactions(timeout_s)
            except KafkaException as exc:
                raise _classify(exc.args[0], "init_transactions") from exc

    @property
    def transactional(self) -> bool:
        return self.transactional_id is not None

    def publish(
        self, event: EventOrDocument, *, topic: str | None = None, partition: int | None = None,
        timeout_s: float | None = None,
    ) -> RecordPosition:
        """Validate and write one event; returns where it landed once it is durable."""
        return self.publish_all([(event, topic, partition)], timeout_s=timeout_s)[0]

    def publish_all(
        self, items: Iterable[tuple[EventOrDocument, str | None, int | None]], *,
        timeout_s: float | None = None,
    ) -> list[RecordPosition]:
        """Write several events atomically (one transaction) or, if idempotent, in order.

        `timeout_s` (default: the producer's) bounds the commit or flush.
        """
        encoded = []
        for event, topic, partition in items:
            envelope, value = encode(event)  # raises EventValidationError naming the field
            encoded.append((topic or topic_for(envelope, self.settings), partition, envelope,
                            value))
        left = _budget(self.timeout_s if timeout_s is None else timeout_s)
        if not self._lock.acquire(timeout=left()):
            raise BrokerUnavailable("the producer is busy with an earlier write")
        try:
            if self._fenced:
                raise ProducerFenced("this producer was fenced by a newer instance")
            try:
                self._settle(left)
                return self._write(encoded, left)
            except EventLogError as exc:
                self._note(exc)
                raise
        finally:
            self._lock.release()

    def recover(self, timeout_s: float) -> None:
        """Settle a transaction a failed write left open (no-op otherwise)."""
        with self._lock:
            if self._fenced:
                raise ProducerFenced("this producer was fenced by a newer instance")
            try:
                self._settle(_budget(timeout_s))
            except EventLogError as exc:
                self._note(exc)
                raise

    def _note(self, error: EventLogError) -> None:
        """Remember what a failed step says about this client: fenced for good, or lost."""
        if isinstance(error, ProducerFenced):
            self._fenced = True
        elif isinstance(error, ProducerLost):
            self._lost = True

    def _settle(self, left: Callable[[], float]) -> None:
        """Replace a lost client, then resume the commit that timed out, or abort; raises
        while the broker says no. `left()`: seconds left of the caller's budget, shared by
        every step."""
        if self._lost:
            self._replace(left)
        while self._unsettled is not None:
            action = self._unsettled
            try:
                if action == "commit":
                    self._producer.commit_transaction(left())
                else:
                    self._producer.abort_transaction(left())
            except KafkaException as exc:
                error = exc.args[0]
                if action == "commit" and error.txn_requires_abort():
                    self._unsettled = "abort"
                    continue
                failure = _classify(error, f"settling the failed transaction ({action})")
                if not isinstance(failure, ProducerLost):
                    raise failure from exc
                # Nobody has initialised the id since (see the module docstring), so a new
                # client takes over now, and its initialisation settles the transaction on
                # the broker: the write that follows need not fail as well.
                self._lost = True
                self._replace(left)
                return
            self._unsettled = None

    def _replace(self, left: Callable[[], float]) -> None:
        """A new client under the same id. Initialising it also settles, on the broker, the
        transaction the lost one left (an open one is aborted, a prepared commit completes),
        so nothing stays unsettled here. The lost client is only dropped: purging in-flight
        messages of an idempotent client is what librdkafka warns against."""
        self._producer = Producer(self._config)
        self._init_transactions(left())
        self._lost = False
        self._unsettled = None

    def _write(
        self, encoded: list[tuple[str, int | None, Envelope, bytes]], left: Callable[[], float]
    ) -> list[RecordPosition]:
        results: list[RecordPosition | EventLogError | None] = [None] * len(encoded)

        def on_delivery(index: int) -> Any:
            def callback(error: KafkaError | None, message: Message) -> None:
                if error is not None:
                    results[index] = _classify(error, "delivery")
                else:
                    results[index] = RecordPosition(
                        message.topic(), message.partition(), message.offset())
            return callback

        try:
            if self.transactional:
                self._producer.begin_transaction()
            for index, (topic, partition, envelope, value) in enumerate(encoded):
                kwargs: dict[str, Any] = {"key": envelope.stream.encode(), "value": value,
                                          "on_delivery": on_delivery(index),
                                          "headers": {"type": envelope.type}}
                if partition is not None:
                    kwargs["partition"] = partition
                self._producer.produce(topic, **kwargs)
            if self.transactional:
                self._producer.commit_transaction(left())
            else:
                remaining = self._producer.flush(left())
                if remaining:
                    raise BrokerUnavailable(f"{remaining} event(s) not acknowledged in time")
        except KafkaException as exc:
            error = exc.args[0]
            if self.transactional and not (error.code() in _FENCED or error.fatal()):
                committing = error.retriable() and not error.txn_requires_abort()
                self._leave_unsettled("commit" if committing else "abort", left)
            raise _classify(error, "produce") from exc
        except BufferError as exc:
            if self.transactional:
                self._leave_unsettled("abort", left)
            raise BrokerUnavailable(f"local queue full: {exc}") from exc
        self._producer.poll(0)
        for result in results:
            if isinstance(result, EventLogError):
                raise result
            if result is None:
                raise BrokerUnavailable("no delivery report received")
        return [r for r in results if isinstance(r, RecordPosition)]

    def _leave_unsettled(self, action: Literal["commit", "abort"],
                         left: Callable[[], float]) -> None:
        """A write failed inside its transaction: abort it now if the broker answers, else
        settle it before the next write. A commit that timed out is left to be resumed:
        only the broker knows whether it went through."""
        self._unsettled = action
        if action == "commit":
            return
        try:
            self._settle(left)
        except EventLogError as exc:
            self._note(exc)  # the caller raises the write's own error

    def close(self) -> None:
        if not self._fenced and not self._lost and self._unsettled is None:
            self._producer.flush(self.timeout_s)

    def __enter__(self) -> EventProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _budget(seconds: float) -> Callable[[], float]:
    """Seconds left of one budget shared by every step of a call (the lock, settling a failed
    transaction, the write), never below the 10 ms librdkafka needs to answer at all."""
    end = time.monotonic() + seconds
    return lambda: max(0.01, end - time.monotonic())
