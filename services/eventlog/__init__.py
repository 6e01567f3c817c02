"""Kafka plumbing: one producer wrapper, one consumer wrapper, topic bootstrap."""

from services.eventlog.consumer import EventConsumer, Record
from services.eventlog.errors import BrokerUnavailable, EventLogError, ProducerFenced
from services.eventlog.producer import EventProducer, RecordPosition
from services.eventlog.topics import ensure_topics, topic_for

__all__ = [
    "BrokerUnavailable",
    "EventConsumer",
    "EventLogError",
    "EventProducer",
    "ProducerFenced",
    "Record",
    "RecordPosition",
    "ensure_topics",
    "topic_for",
]
