"""The one consumer wrapper: read_committed, validated, deduplicated by `event_id`.

Two modes. Fan-out readers (registry, workers, router) call it without a group and get
every partition of every topic by `assign()`, from the beginning or from offsets they
keep themselves (the projector keeps them in Postgres, followers in snapshots). Group mode
exists for readers that share work; it commits only after the handler has run.

Catching up: a reader has seen everything committed before moment T once every assigned
partition has reported its end (partition EOF) from a fetch begun after T. A fresh
assignment is such a fetch; `restart_catch_up` seeks every partition to its own position
so that the next fetch is one too. The end a fetch reports is the broker's high watermark
(the last stable offset under read_committed) at that fetch, which is exact on Apache
Kafka and on Tansu alike, while the offsets a ListOffsets request returns are not on
Tansu (KAFKA_NOTES). So nothing is written to know where the log ends: the kept-forever
adapter log holds domain events only. (Earlier readers wrote `ReplayBarrier` records for
this; those still in a log are skipped.)

A record that is not valid JSON or fails its schema never reaches the handler: it goes to
the dead-letter path with the reason and the consumer goes on. A reader may name the
event types it folds (`wanted_types`): records whose `type` header names another type are
skipped without being decoded, which is most of what a catalog reader would otherwise
parse (request traces).

A reader resuming from a snapshot passes `anchors`: for each partition, the last record
the snapshot covers. It starts at that record and checks it is the same one (offset,
broker timestamp, checksum of key and value); any other record there, or the log ending
before it, raises `AnchorMismatch`: the log is not the one the snapshot was taken from.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

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
from services.eventlog.client import consumer_config, producer_config
from services.eventlog.errors import BrokerUnavailable, EventLogError

log = logging.getLogger(__name__)

TopicPartitionKey = tuple[str, int]


class DecodedEvent(Protocol):
    """What the consumer needs of a decoded event (a model or a `contracts.structs` one)."""

    @property
    def event_id(self) -> uuid.UUID: ...

    @property
    def is_barrier(self) -> bool: ...


E = TypeVar("E", bound=DecodedEvent)
"""The event type a consumer hands on: `Envelope` unless it was given another decoder."""
Decoder = Callable[[bytes | None], Any]
"""Record value → event; raises EventValidationError (the record is dead-lettered)."""


class Record(NamedTuple, Generic[E]):
    """A validated event and where it sits in the log.

    A named tuple, not a frozen dataclass: a busy reader builds one per record, and a
    frozen dataclass's `__init__` (one `object.__setattr__` per field) cost the audit
    projector more than a tenth of its consumer loop."""

    topic: str
    partition: int
    offset: int
    envelope: E
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


@dataclass(frozen=True)
class Anchor:
    """One record, identified well enough to tell whether a log still holds it."""

    offset: int
    timestamp: int
    checksum: int

    @classmethod
    def of(cls, message: Message) -> Anchor:
        key, value = message.key() or b"", message.value() or b""
        return cls(message.offset(), message.timestamp()[1], zlib.crc32(value, zlib.crc32(key)))

    def to_json(self) -> list[int]:
        return [self.offset, self.timestamp, self.checksum]

    @classmethod
    def from_json(cls, value: Sequence[int]) -> Anchor:
        offset, timestamp, checksum = (int(v) for v in value)
        return cls(offset, timestamp, checksum)


class AnchorMismatch(EventLogError):
    """The log does not hold the record a snapshot ends with: it was lost or recreated."""


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

    def add_all(self, event_ids: Iterable[uuid.UUID]) -> list[bool]:
        """`add` for a batch, in order (a repeat within it is not new), trimmed once."""
        ids = self._ids
        new = []
        for event_id in event_ids:
            if event_id in ids:
                ids.move_to_end(event_id)
                new.append(False)
            else:
                ids[event_id] = None
                new.append(True)
        while len(ids) > self.capacity:
            ids.popitem(last=False)
        return new


class EventConsumer(Generic[E]):
    """Reads events from `topics`; see the module docstring for the two modes.

    `decoder` turns a record value into the event handed on: by default the pydantic
    model (`codec.decode`); the audit projector passes `contracts.structs.decode`, which
    validates the same contract without building models.
    """

    def __init__(
        self,
        settings: Settings,
        topics: Sequence[str],
        *,
        reader_id: str,
        group_id: str | None = None,
        start_offsets: Mapping[TopicPartitionKey, int] | None = None,
        anchors: Mapping[TopicPartitionKey, Anchor] | None = None,
        wanted_types: Collection[str] | None = None,
        on_rejected: RejectedSink | None = None,
        dedupe_capacity: int = 200_000,
        decoder: Decoder = decode,
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
        self._decode = decoder
        self._own_dead_letters: KafkaDeadLetters | None = None
        self._seen = RecentIds(dedupe_capacity)
        self._positions: dict[TopicPartitionKey, int] = {}
        self._starts: dict[TopicPartitionKey, int] = {}
        self._eof_pending: set[TopicPartitionKey] = set()
        self._last: dict[TopicPartitionKey, Message] = {}
        self._anchors = dict(anchors or {})
        self._wanted = frozenset(wanted_types) if wanted_types is not None else None
        self.cluster_id: str | None = None
        self._fresh = False
        """Assigned and not polled yet: the first fetches will start after now anyway."""
        self._closed = False
        if group_id:
            self._consumer.subscribe(self.topics)
        else:
            start = dict(start_offsets or {})
            start.update({key: anchor.offset for key, anchor in self._anchors.items()})
            try:
                self._assign_all(start)
            except BaseException:
                self._consumer.close()
                raise

    # --- setup -----------------------------------------------------------------------------

    def _assign_all(self, start_offsets: Mapping[TopicPartitionKey, int]) -> None:
        try:
            metadata = self._consumer.list_topics(timeout=15)
        except KafkaException as exc:
            raise BrokerUnavailable(f"cannot read metadata: {exc}") from exc
        self.cluster_id = metadata.cluster_id
        assignment = []
        for topic in self.topics:
            info = metadata.topics.get(topic)
            if info is None or info.error is not None or not info.partitions:
                raise EventLogError(f"topic {topic!r} does not exist; run topic bootstrap first")
            for partition in sorted(info.partitions):
                offset = start_offsets.get((topic, partition), OFFSET_BEGINNING)
                assignment.append(TopicPartition(topic, partition, offset))
                self._starts[(topic, partition)] = offset
                if offset >= 0:
                    self._positions[(topic, partition)] = offset
        unknown = set(self._anchors) - set(self._starts)
        if unknown:
            raise AnchorMismatch(f"anchored partitions {sorted(unknown)} do not exist")
        for (topic, partition), anchor in self._anchors.items():
            self._check_in_range(topic, partition, anchor)
        self._consumer.assign(assignment)
        self._eof_pending = set(self._starts)
        self._fresh = True

    def _check_in_range(self, topic: str, partition: int, anchor: Anchor) -> None:
        """The anchored record must lie inside the partition's offsets (a cheap first check,
        before its content is compared: on a broker that lost its log, a fetch past the end
        may just wait instead of failing). Tansu reports too low a high watermark, which can
        only send a reader to a full replay it did not need."""
        try:
            low, high = self._consumer.get_watermark_offsets(
                TopicPartition(topic, partition), timeout=10, cached=False)
        except KafkaException as exc:
            raise BrokerUnavailable(f"cannot read offsets of {topic}[{partition}]: {exc}") from exc
        if not low <= anchor.offset < high:
            raise AnchorMismatch(f"{topic}[{partition}] holds offsets {low}..{high - 1}, not the "
                                 f"anchored record at {anchor.offset}")

    @property
    def anchors_pending(self) -> bool:
        """Some anchored record has not been read and checked yet."""
        return bool(self._anchors)

    @property
    def partitions(self) -> list[TopicPartitionKey]:
        """Every assigned partition (fan-out mode)."""
        return sorted(self._starts)

    @property
    def assignment(self) -> list[TopicPartitionKey]:
        return [(tp.topic, tp.partition) for tp in self._consumer.assignment()]

    def positions(self) -> dict[TopicPartitionKey, int]:
        """Next offset to read per partition, covering every record consumed so far."""
        return dict(self._positions)

    # --- reading ---------------------------------------------------------------------------

    def poll(self, timeout: float = 0.5, max_records: int = 500) -> list[Record[E]]:
        """Up to `max_records` new, valid, not-yet-seen events (barriers are not returned)."""
        self._fresh = False
        try:
            messages = self._consumer.consume(num_messages=max_records, timeout=timeout)
        except KafkaException as exc:
            raise BrokerUnavailable(f"consume failed: {exc}") from exc
        if self._anchors or self._wanted is not None:
            return [r for r in map(self._accept, messages) if r is not None]
        return self._accept_all(messages)

    def _accept_all(self, messages: list[Message]) -> list[Record[E]]:
        """`_accept` for a whole batch when no anchor or type filter applies (the audit
        projector's reads): positions and the last record are set once per partition and
        the batch is deduplicated in one pass, instead of per record. Errors (partition
        ends) take `_accept` after the positions read before them are settled, so the
        result is the same record for record."""
        record_of = self._record
        reading: dict[TopicPartitionKey, Message] = {}
        decoded: list[Record[E]] = []
        try:
            for message in messages:
                if message.error() is not None:
                    self._settle(reading)
                    self._accept(message)
                    continue
                key = (message.topic(), message.partition())
                reading[key] = message
                record = record_of(key, message)
                if record is not None:
                    decoded.append(record)
        finally:  # whatever raised, the positions cover what was read, as `_accept`'s do
            self._settle(reading)
        new = self._seen.add_all([r.envelope.event_id for r in decoded])
        return [r for r, is_new in zip(decoded, new, strict=True) if is_new]

    def _settle(self, reading: dict[TopicPartitionKey, Message]) -> None:
        """Move the positions past the last record read of each partition."""
        for key, message in reading.items():
            self._positions[key] = message.offset() + 1
            self._last[key] = message
        reading.clear()

    def _accept(self, message: Message) -> Record[E] | None:
        error = message.error()
        key = (message.topic(), message.partition())
        if error is not None:
            if error.code() == KafkaError._PARTITION_EOF:
                anchor = self._anchors.get(key)
                if anchor is not None:
                    raise AnchorMismatch(f"{key[0]}[{key[1]}] ends at {message.offset()}, "
                                         f"before the anchored record at {anchor.offset}")
                self._positions[key] = max(self._positions.get(key, 0), message.offset())
                self._eof_pending.discard(key)
                return None
            if error.code() in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_PARTITION):
                raise EventLogError(f"{key}: {error.str()}")
            log.warning("consumer %s: %s", self.reader_id, error.str())
            return None
        offset = message.offset()
        if self._anchors:
            anchor = self._anchors.pop(key, None)
            if anchor is not None:
                if Anchor.of(message) != anchor:
                    raise AnchorMismatch(f"{key[0]}[{key[1]}]@{offset} is not the anchored "
                                         f"record {anchor}")
                self._positions[key] = offset + 1
                self._last[key] = message
                return None  # the snapshot already covers it
        self._positions[key] = offset + 1
        self._last[key] = message
        if self._wanted is not None:
            headers = message.headers()
            event_type = next((v for k, v in headers if k == "type"), None) if headers else None
            if event_type is not None and event_type.decode(errors="replace") not in self._wanted:
                return None
        record = self._record(key, message)
        if record is None or not self._seen.add(record.envelope.event_id):
            return None
        return record

    def _record(self, key: TopicPartitionKey, message: Message) -> Record[E] | None:
        """The record of one data message, or None for a barrier or an invalid value (sent
        to the dead letters). Deduplication is the caller's: one by one or per batch."""
        value = message.value()
        try:
            envelope: E = self._decode(value)
        except EventValidationError as exc:
            self._reject(Rejected(key[0], key[1], message.offset(), message.key(), value,
                                  str(exc)))
            return None
        if envelope.is_barrier:
            return None
        return Record(key[0], key[1], message.offset(), envelope, value or b"")

    def _reject(self, rejected: Rejected) -> None:
        log.warning("dead-lettering %s[%d]@%d: %s", rejected.topic, rejected.partition,
                    rejected.offset, rejected.reason)
        if self._on_rejected is not None:
            self._on_rejected(rejected)
            return
        if self._own_dead_letters is None:
            self._own_dead_letters = KafkaDeadLetters(self.settings)
        self._own_dead_letters(rejected)

    @property
    def caught_up(self) -> bool:
        """Every assigned partition reported its end since the assignment or the last
        `restart_catch_up` (see the module doc)."""
        return not self._eof_pending

    @property
    def behind(self) -> list[TopicPartitionKey]:
        """Partitions that have not reported their end yet."""
        return sorted(self._eof_pending)

    def restart_catch_up(self) -> None:
        """Start catching up to the log as it is now: seek every partition to where this
        reader stands, so each reports its end anew from a fetch that starts now."""
        for key, start in self._starts.items():
            offset = self._positions.get(key, start)
            self._consumer.seek(TopicPartition(key[0], key[1], offset))
        self._eof_pending = set(self._starts)

    def last_read(self) -> dict[TopicPartitionKey, Anchor]:
        """The last record read from each partition (for a snapshot's anchors)."""
        return {key: Anchor.of(message) for key, message in self._last.items()}

    def catch_up(self, handle: Callable[[Record], None], *, timeout_s: float = 60.0) -> int:
        """Hand over every record committed before this call; returns how many."""
        if not self._fresh:
            self.restart_catch_up()
        handled = 0
        deadline = time.monotonic() + timeout_s
        while self._eof_pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.reader_id} did not reach the end of {self.behind}")
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
