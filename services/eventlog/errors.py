"""Failures of the event log that callers must tell apart (503 vs fenced vs bad input)."""

from __future__ import annotations


class EventLogError(RuntimeError):
    """A produce or consume that did not complete; nothing half-written is visible."""


class BrokerUnavailable(EventLogError):
    """The broker did not answer in time; safe to retry the whole command later."""


class ProducerFenced(EventLogError):
    """Another producer took over this transactional id; this one must stop writing."""


class ProducerLost(EventLogError):
    """The client hit a fatal error that is not fencing (the broker still accepted its epoch):
    this write failed, and the next one starts a new client under the same id."""
