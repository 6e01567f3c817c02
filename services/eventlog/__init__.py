"""Kafka plumbing: producer and consumer wrappers, topic bootstrap, and the log follower
(the reader loop with snapshots that every folding process runs)."""

from services.eventlog.backoff import Backoff
from services.eventlog.consumer import EventConsumer, Record
from services.eventlog.errors import (
    BrokerUnavailable,
    EventLogError,
    ProducerFenced,
    ProducerLost,
)
from services.eventlog.follower import Fold, FollowerHalted, Halt, LogFollower
from services.eventlog.producer import EventProducer, RecordPosition
from services.eventlog.topics import ensure_topics, topic_for

__all__ = [
    "Backoff",
    "BrokerUnavailable",
    "EventConsumer",
    "EventLogError",
    "EventProducer",
    "Fold",
    "FollowerHalted",
    "Halt",
    "LogFollower",
    "ProducerFenced",
    "ProducerLost",
    "Record",
    "RecordPosition",
    "ensure_topics",
    "topic_for",
]
