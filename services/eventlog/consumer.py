"""The one consumer wrapper: read_committed, validated, deduplicated by `event_id`.

Two modes. Fan-out readers (registry, workers, router) call it without a group and get
every partition of every topic by `assign()`, from the beginning or from offsets they
keep themselves (the projector keeps them in Postgres). Group mode exists for readers
that share work; it commits only after the handler has run.

Catching up is detected by a barrier: the reader writes a `ReplayBarrier` to every
partition it reads and waits until its position passes each barrier's offset. The high
watermark is not used because not every broker reports it correctly (KAFKA_NOTES).
A record that is not valid JSON or fails its schema never reaches the handler: it goes to
the dead-letter path with the reason and the consumer goes on.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)

from services.config import Settings
from services.contracts.codec import EventValidationError, decode
from services.contracts.events import Envelope, ReplayBarrier
from services.eventlog.client import consumer_config, producer_config
from services.eventlog.errors import BrokerUnavailable, EventLogError
from services.eventlog.producer import EventProducer

log = logging.getLogger(__name__)

TopicPartitionKey = tuple[str, int]


@dataclass(frozen=True)
class Record:
    """A validated event and where it sits in the log."""

    topic: str
    partition: int
    offset: int
    envelope: Envelope
    value: bytes


@dataclass(frozen=True)
class Rejected:
    """A record that failed validation, kept whole for the dead-letter path."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    reason: str


RejectedSink = Callable[[Rejected], None]


class KafkaDeadLetters:
    """Default dead-letter path: the raw record and its reason on the dead-letter topic."""

    def __init__(self, settings: Settings) -> None:
        self.topic = settings.dead_letter_topic
        self._producer = Producer(producer_config(settings, "loraplane-dead-letters"))

    def __call__(self, rejected: Rejected) -> None:
        self._producer.produce(
            self.topic,
            key=rejected.key,
            value=rejected.value,
            headers={
                "reason": rejected.reason.encode(),
                "source.topic": rejected.topic.encode(),
                "source.partition": str(rejected.partition).encode(),
                "source.offset": str(rejected.offset).encode(),
            },
        )
        self._producer.flush(10)

    def close(self) -> None:
        self._producer.flush(10)


class RecentIds:
    """A bounded set of recently seen event ids: redelivery is recent, memory is not free."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[uuid.UUID, None] = OrderedDict()

    def add(self, event_id: uuid.UUID) -> bool:
        """True if new; False if it was already seen."""
        if event_id in self._ids:
            self._ids.move_to_end(event_id)
            return False
        self._ids[event_id] = None
        if len(self._ids) > self.capacity:
            self._ids.popitem(last=False)
        return True


class EventConsumer:
    """Reads events from `topics`; see the module docstring for the two modes."""

    def __init__(
        self,
        settings: Settings,
        topics: Sequence[str],
        *,
        reader_id: str,
        group_id: str | None = None,
        start_offsets: Mapping[TopicPartitionKey, int] | None = None,
        on_rejected: RejectedSink | None = None,
        dedupe_capacity: int = 200_000,
        **overrides: object,
    ) -> None:
        self.settings = settings
        self.topics = list(topics)
        self.reader_id = reader_id
        self.group_id = group_id
        extra = dict(overrides)
        if group_id:
            extra["group.id"] = group_id
        self._consumer = Consumer(consumer_config(settings, reader_id, **extra))
        self._on_rejected = on_rejected
        self._own_dead_letters: KafkaDeadLetters | None = None
        self._seen = RecentIds(dedupe_capacity)
        self._positions: dict[TopicPartitionKey, int] = {}
        self._eof: set[TopicPartitionKey] = set()
        self._closed = False
        if group_id:
            self._consumer.subscribe(self.topics)
        else:
            self._assign_all(start_offsets or {})

    # --- setup -----------------------------------------------------------------------------

    def _assign_all(self, start_offsets: Mapping[TopicPartitionKey, int]) -> None:
        try:
            metadata = self._consumer.list_topics(timeout=15)
        except KafkaException as exc:
            raise BrokerUnavailable(f"cannot read metadata: {exc}") from exc
        assignment = []
        for topic in self.topics:
            info = metadata.topics.get(topic)
            if info is None or info.error is not None or not info.partitions:
                raise EventLogError(f"topic {topic!r} does not exist; run topic bootstrap first")
            for partition in sorted(info.partitions):
                offset = start_offsets.get((topic, partition), OFFSET_BEGINNING)
                assignment.append(TopicPartition(topic, partition, offset))
                if offset >= 0:
                    self._positions[(topic, partition)] = offset
        self._consumer.assign(assignment)

    @property
    def assignment(self) -> list[TopicPartitionKey]:
        return [(tp.topic, tp.partition) for tp in self._consumer.assignment()]

    def positions(self) -> dict[TopicPartitionKey, int]:
        """Next offset to read per partition, covering every record consumed so far."""
        return dict(self._positions)

    # --- reading ---------------------------------------------------------------------------

    def poll(self, timeout: float = 0.5, max_records: int = 500) -> list[Record]:
        """Up to `max_records` new, valid, not-yet-seen events (barriers are not returned)."""
        try:
            messages = self._consumer.consume(num_messages=max_records, timeout=timeout)
        except KafkaException as exc:
            raise BrokerUnavailable(f"consume failed: {exc}") from exc
        records = []
        for message in messages:
            record = self._accept(message)
            if record is not None:
                records.append(record)
        return records

    def _accept(self, message: Message) -> Record | None:
        error = message.error()
        key = (message.topic(), message.partition())
        if error is not None:
            if error.code() == KafkaError._PARTITION_EOF:
                self._eof.add(key)
                return None
            if error.code() in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_PARTITION):
                raise EventLogError(f"{key}: {error.str()}")
            log.warning("consumer %s: %s", self.reader_id, error.str())
            return None
        self._eof.discard(key)
        offset = message.offset()
        self._positions[key] = offset + 1
        value = message.value()
        try:
            envelope = decode(value)
        except EventValidationError as exc:
            self._reject(Rejected(key[0], key[1], offset, message.key(), value, str(exc)))
            return None
        if envelope.is_barrier or not self._seen.add(envelope.event_id):
            return None
        return Record(key[0], key[1], offset, envelope, value or b"")

    def _reject(self, rejected: Rejected) -> None:
        log.warning("dead-lettering %s[%d]@%d: %s", rejected.topic, rejected.partition,
                    rejected.offset, rejected.reason)
        if self._on_rejected is not None:
            self._on_rejected(rejected)
            return
        if self._own_dead_letters is None:
            self._own_dead_letters = KafkaDeadLetters(self.settings)
        self._own_dead_letters(rejected)

    def at_eof(self) -> bool:
        """True when every assigned partition reported EOF (a hint; barriers are the proof)."""
        return set(self.assignment) <= self._eof

    def catch_up(
        self,
        handle: Callable[[Record], None],
        *,
        producer: EventProducer | None = None,
        timeout_s: float = 60.0,
    ) -> int:
        """Write a barrier to each assigned partition and fold every record before it.

        Returns the number of records handled. `producer` is the caller's own (the
        registry passes its transactional one); otherwise an idempotent one is used.
        """
        assigned = self.assignment
        nonce = uuid.uuid4().hex
        barriers = [
            (Envelope.new(ReplayBarrier(reader=self.reader_id, nonce=nonce, partition=p),
                          stream=f"barrier/{self.reader_id}/{nonce}/{t}/{p}", seq=1,
                          actor=self.reader_id), t, p)
            for t, p in assigned
        ]
        own = producer is None
        writer = producer or EventProducer(self.settings, client_id=f"{self.reader_id}-barrier")
        try:
            written = writer.publish_all(barriers)
        finally:
            if own:
                writer.close()
        targets = {(pos.topic, pos.partition): pos.offset for pos in written}
        handled = 0
        deadline = time.monotonic() + timeout_s
        while any(self._positions.get(tp, -1) <= offset for tp, offset in targets.items()):
            if time.monotonic() > deadline:
                behind = {tp: (self._positions.get(tp), o) for tp, o in targets.items()
                          if self._positions.get(tp, -1) <= o}
                raise TimeoutError(f"{self.reader_id} did not reach its barriers: {behind}")
            for record in self.poll(timeout=0.2):
                handle(record)
                handled += 1
        return handled

    def run(
        self,
        handle: Callable[[Record], None],
        stop: threading.Event,
        *,
        poll_timeout: float = 0.2,
    ) -> None:
        """Hand every record to `handle` until `stop` is set; commits in group mode."""
        while not stop.is_set():
            records = self.poll(timeout=poll_timeout)
            for record in records:
                handle(record)
            if records and self.group_id:
                self.commit()

    def commit(self) -> None:
        if not self.group_id or not self._positions:
            return
        offsets = [TopicPartition(t, p, o) for (t, p), o in self._positions.items()]
        self._consumer.commit(offsets=offsets, asynchronous=False)

    def seek(self, positions: Iterable[tuple[str, int, int]]) -> None:
        for topic, partition, offset in positions:
            self._consumer.seek(TopicPartition(topic, partition, offset))
            self._positions[(topic, partition)] = offset

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self.group_id:
                self.commit()
        finally:
            self._consumer.close()
            if self._own_dead_letters is not None:
                self._own_dead_letters.close()

    def __enter__(self) -> EventConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
