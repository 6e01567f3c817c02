"""Transaction guarantees the registry relies on, proven on Apache Kafka (Tansu lacks them:
see KAFKA_NOTES)."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer

from services.config import Settings
from services.contracts.codec import encode
from services.eventlog import BrokerUnavailable, EventConsumer, EventProducer, ProducerFenced
from tests.eventlog.test_plumbing import disabled, read_all

pytestmark = pytest.mark.slow


def test_read_committed_never_sees_an_aborted_message(settings: Settings) -> None:
    raw = Producer({"bootstrap.servers": settings.kafka_bootstrap,
                    "transactional.id": "aborter", "enable.idempotence": True})
    raw.init_transactions(10)
    aborted = disabled(1)
    raw.begin_transaction()
    raw.produce(settings.adapter_events_topic, key=aborted.stream.encode(),
                value=encode(aborted)[1])
    raw.flush(10)  # on the broker, inside an open transaction
    raw.abort_transaction(10)
    committed = disabled(2)
    with EventProducer(settings, transactional_id="committer") as producer:
        producer.publish(committed)
    seen = read_all(settings, "reader-committed")
    assert [e.event_id for e in seen] == [committed.event_id]


def test_second_producer_with_same_transactional_id_fences_the_first(settings: Settings) -> None:
    first = EventProducer(settings, transactional_id="registry-fence")
    first.publish(disabled(1))
    second = EventProducer(settings, transactional_id="registry-fence")
    with pytest.raises(ProducerFenced):
        first.publish(disabled(2, seq=2))
    with pytest.raises(ProducerFenced):  # stays fenced, fails fast
        first.publish(disabled(3, seq=3))
    second.publish(disabled(4, seq=4))
    second.close()
    seen = read_all(settings, "reader-fenced")
    assert [e.payload.version for e in seen] == [1, 4]


def test_catch_up_ends_at_an_open_transaction_and_sees_it_once_committed(
        settings: Settings) -> None:
    with EventProducer(settings, transactional_id="registry-eof") as producer:
        producer.publish(disabled(1))
    raw = Producer({"bootstrap.servers": settings.kafka_bootstrap,
                    "transactional.id": "other-writer"})
    raw.init_transactions(10)
    raw.begin_transaction()
    pending = disabled(2)
    raw.produce(settings.adapter_events_topic, key=pending.stream.encode(),
                value=encode(pending)[1], headers={"type": pending.type})
    raw.flush(10)
    seen: list = []
    with EventConsumer(settings, [settings.adapter_events_topic],
                       reader_id="registry") as consumer:
        consumer.catch_up(lambda r: seen.append(r.envelope), timeout_s=20)
        assert [e.payload.version for e in seen] == [1]  # the open one is not committed
        raw.commit_transaction(10)
        consumer.catch_up(lambda r: seen.append(r.envelope), timeout_s=20)
    assert [e.payload.version for e in seen] == [1, 2]


def test_group_mode_commits_after_handling_and_resumes(settings: Settings) -> None:
    with EventProducer(settings) as producer:
        producer.publish(disabled(1))
        producer.publish(disabled(2))
    group = "loraplane-test-group"
    first: list[int] = []
    consumer = EventConsumer(settings, [settings.adapter_events_topic], reader_id="g1",
                             group_id=group)
    for _ in range(100):
        for record in consumer.poll(timeout=0.2):
            first.append(record.envelope.payload.version)
        if len(first) == 2:
            break
    consumer.close()  # commits what was handled and leaves the group
    assert first == [1, 2]
    with EventProducer(settings) as producer:
        producer.publish(disabled(3))
    second: list[int] = []
    consumer = EventConsumer(settings, [settings.adapter_events_topic], reader_id="g2",
                             group_id=group)
    for _ in range(100):
        second.extend(r.envelope.payload.version for r in consumer.poll(timeout=0.2))
        if second:
            break
    consumer.close()
    assert second == [3], "a restarted group member resumes after the committed offset"


def test_a_commit_that_timed_out_is_resumed_and_a_fenced_producer_never_reinitialises(
        settings: Settings) -> None:
    from tests.registry.test_single_writer import FailingCommits

    first = EventProducer(settings, transactional_id="writer")
    first._producer = FailingCommits(first._producer)  # type: ignore[assignment]
    with pytest.raises(BrokerUnavailable):
        first.publish(disabled(1))  # its commit timed out: outcome unknown
    first.recover(10)  # resumes that commit: it goes through
    first.publish(disabled(2, seq=2))
    second = EventProducer(settings, transactional_id="writer")  # fences `first`
    with pytest.raises(ProducerFenced):
        first.publish(disabled(3, seq=3))
    with pytest.raises(ProducerFenced):
        first.recover(10)  # and it stays fenced: it never initialises the id again
    second.publish(disabled(4, seq=4))
    second.close()
    assert [e.payload.version for e in read_all(settings, "reader-resumed")] == [1, 2, 4]


class RefusedAbort:
    """A confluent Producer whose next commit needs an abort and whose abort the broker then
    refuses with a fatal INVALID_TXN_STATE, as after a broker restart when the coordinator
    never registered the transaction's partitions. All else reaches the real producer."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def commit_transaction(self, *args: Any) -> None:
        raise KafkaException(KafkaError(KafkaError._MSG_TIMED_OUT, "injected: message timed out",
                                        txn_requires_abort=True))

    def abort_transaction(self, *args: Any) -> None:
        self._inner.abort_transaction(*args)  # the client dropped afterwards holds nothing open
        raise KafkaException(KafkaError(
            KafkaError.INVALID_TXN_STATE,
            "injected: Producer attempted a transactional operation in an invalid state",
            fatal=True))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_a_fatal_answer_that_is_not_fencing_replaces_the_client_and_keeps_the_writer(
        settings: Settings) -> None:
    first = EventProducer(settings, transactional_id="writer-lost")
    first.publish(disabled(1))
    first._producer = RefusedAbort(first._producer)  # type: ignore[assignment]
    with pytest.raises(BrokerUnavailable):
        first.publish(disabled(2, seq=2))  # its transaction can neither commit nor abort
    first.publish(disabled(3, seq=3))  # a new client: the open transaction is aborted
    second = EventProducer(settings, transactional_id="writer-lost")  # a real fence still holds
    with pytest.raises(ProducerFenced):
        first.publish(disabled(4, seq=4))
    second.publish(disabled(5, seq=5))
    second.close()
    assert [e.payload.version for e in read_all(settings, "reader-lost")] == [1, 3, 5]


class UnreachableThenRefusedAbort(RefusedAbort):
    """The drill's sequence: a write fails while the broker is down, so its abort cannot
    reach the coordinator either; once the broker is back, the abort is refused with the
    fatal INVALID_TXN_STATE."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.aborts = 0

    def abort_transaction(self, *args: Any) -> None:
        self.aborts += 1
        if self.aborts == 1:
            raise KafkaException(KafkaError(KafkaError._TRANSPORT, "injected: broker down",
                                            retriable=True))
        super().abort_transaction(*args)


def test_an_abort_refused_after_a_broker_restart_does_not_fail_the_next_write(
        settings: Settings) -> None:
    producer = EventProducer(settings, transactional_id="writer-restarted")
    producer.publish(disabled(1))
    refusing = UnreachableThenRefusedAbort(producer._producer)
    producer._producer = refusing  # type: ignore[assignment]
    with pytest.raises(BrokerUnavailable):
        producer.publish(disabled(2, seq=2))  # neither its commit nor its abort got through
    producer.publish(disabled(3, seq=3))  # the refused abort: a new client, then this write
    assert refusing.aborts == 2 and producer._producer is not refusing
    producer.close()
    assert [e.payload.version for e in read_all(settings, "reader-restarted")] == [1, 3]
