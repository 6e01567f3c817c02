"""The checker of a fault run: the history against the log and the audit store.

Independent of the services' code on purpose: it reads Kafka with the plain Kafka client
and PostgreSQL with plain SQL, parses events as JSON, and implements its own small
model of an adapter. What it verifies (each failure is an `Anomaly`):

1. writes (`writes`): every acknowledged write is in the log exactly once (found by its
   Idempotency-Key), with the version it was acknowledged with; no write reported
   failed is in the log; an unknown one is there at most once;
2. linearizability (`linearizable`): per adapter, the acknowledged and unknown writes
   and the reads a registry marked `linearizable` have an order consistent with their
   real-time order in which a register of (latest version, active version) explains
   every answer (Wing & Gong's search, as Knossos does it, with unknown operations free
   to take effect at any time after their invocation, or never); every other read shows
   a state the log actually went through;
3. the version wall (`version_wall`): no request served a version that the log had
   superseded (another version switched active) longer than `wall_s` before the request
   was sent; and no routed request was refused by the wall while the registry was
   demonstrably committing (a write acknowledged within the last `wall_s` minus what a
   lease may take): the wall is for a registry that cannot write, not a slow one;
4. deadlines (`deadlines`): no generation took longer than its deadline plus slack;
5. served_by (`served_by`): every completed generation is in the `served_by` view with
   the worker, version and digest the client was told;
6. purges (`purges`): every acknowledged purge is `met`, or `missed` naming its missing
   workers, once its deadline has passed;
7. audit chain (`audit_chain`): per partition, the `events` rows are exactly the log's
   records in offset order, and each row's hash is SHA-256(previous hash || stored
   bytes) from a zero genesis;
8. readiness (`readiness`): no registry answered `/readyz` 200 more than the stated bound
   into a window the scenario declares unwritable for it (cut off from the brokers, too
   few brokers for `min.insync.replicas`), nor while a write it held hung on the log
   longer than the bound past its last commit the checker can see (an acknowledged
   write, or a lease in the log, counted as committed as late as a write's deadline
   after it was decided: a slow log commits late, and only the registry knows when).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from confluent_kafka import Consumer, KafkaError, TopicPartition

GENESIS = bytes(32)


@dataclass(frozen=True)
class Anomaly:
    check: str
    detail: str


@dataclass
class LogRecord:
    topic: str
    partition: int
    offset: int
    value: bytes
    event: dict[str, Any]

    @property
    def occurred_at(self) -> float:
        return datetime.fromisoformat(self.event["occurred_at"].replace("Z", "+00:00")) \
            .timestamp()


@dataclass
class Report:
    anomalies: list[Anomaly] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)

    def add(self, check: str, detail: str) -> None:
        self.anomalies.append(Anomaly(check, detail))

    def by_check(self) -> dict[str, int]:
        counts: dict[str, int] = defaultdict(int)
        for anomaly in self.anomalies:
            counts[anomaly.check] += 1
        return dict(counts)

    def to_json(self) -> dict[str, Any]:
        return {"anomalies": [asdict(a) for a in self.anomalies], "stats": self.stats,
                "anomalies_by_check": self.by_check()}


# --- reading the log and the store -----------------------------------------------------------


def _consumer(bootstrap: str, isolation: str) -> Consumer:
    """A consumer of its own group that commits nothing and reports each partition's end.

    librdkafka reports a partition's end only from a fetch that comes back empty, and the
    broker holds a fetch until `fetch.wait.max.ms` has passed: with the default 500 ms, a
    partition written more often than twice a second (three workers' heartbeats) never
    reports it. 10 ms is what the services' readers use."""
    return Consumer({"bootstrap.servers": bootstrap, "group.id": f"checker-{uuid.uuid4()}",
                     "enable.auto.commit": False, "isolation.level": isolation,
                     "enable.partition.eof": True, "auto.offset.reset": "earliest",
                     "fetch.wait.max.ms": 10, "log_level": 0})


def uncommitted_at(bootstrap: str, topic: str, positions: dict[int, int]) -> dict[int, str]:
    """For a reader held short of a partition's end: the record it is held at, read
    uncommitted (an open transaction's record names its writer; none found means only
    transaction markers remain)."""
    found: dict[int, str] = {}
    for partition, position in positions.items():
        probe = _consumer(bootstrap, "read_uncommitted")
        try:
            probe.assign([TopicPartition(topic, partition, max(position, 0))])
            found[partition] = "nothing within 10 s"
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                message = probe.poll(0.5)
                if message is None:
                    continue
                if message.error() is None:
                    found[partition] = f"offset {message.offset()}: {message.value()[:300]!r}"
                elif message.error().code() == KafkaError._PARTITION_EOF:
                    found[partition] = "only transaction markers"
                else:
                    found[partition] = str(message.error())
                break
        finally:
            probe.close()
    return found


def read_topic(bootstrap: str, topic: str, timeout_s: float = 150.0) -> list[LogRecord]:
    """Every committed record of `topic` up to its end when the read starts (or later), in
    offset order per partition.

    A partition is read once it reports its end, or once the reader is past the end it had
    when the read started: a partition still being written to (heartbeats) may not report
    its end for as long as the writes keep coming faster than the fetch wait. `timeout_s`
    exceeds the registry's `transaction.timeout.ms` (60 s) with room for the broker's abort
    sweep. (A transaction still open does not hold the end back: the reader is told it
    reached the end at the first open record.)"""
    consumer = _consumer(bootstrap, "read_committed")
    try:
        metadata = consumer.list_topics(topic, timeout=30)
        partitions = sorted(metadata.topics[topic].partitions)
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1]
                for p in partitions}
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        open_partitions = {p for p in partitions if ends[p] > 0}
        records: list[LogRecord] = []
        deadline = time.monotonic() + timeout_s
        while open_partitions:
            if time.monotonic() > deadline:
                held = {p: consumer.position([TopicPartition(topic, p)])[0].offset
                        for p in open_partitions}
                marks = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=5)
                         for p in open_partitions}
                raise TimeoutError(f"reading {topic}: partitions {open_partitions} not at end "
                                   f"(positions {held}, ends at the start {ends}, (low, high) "
                                   f"watermarks {marks}); what "
                                   f"read_uncommitted finds there: "
                                   f"{uncommitted_at(bootstrap, topic, held)}")
            message = consumer.poll(0.5)
            if message is None:
                continue
            if message.error() is not None:
                if message.error().code() == KafkaError._PARTITION_EOF:
                    open_partitions.discard(message.partition())
                    continue
                raise RuntimeError(f"reading {topic}: {message.error()}")
            value = message.value() or b""
            try:
                event = json.loads(value)
            except ValueError:
                event = {}
            records.append(LogRecord(topic, message.partition(), message.offset(), value, event))
            if message.offset() + 1 >= ends[message.partition()]:
                open_partitions.discard(message.partition())
        return records
    finally:
        consumer.close()


# --- 1. writes -------------------------------------------------------------------------------


def check_writes(ops: list[dict[str, Any]], adapter_log: list[LogRecord], report: Report) -> None:
    by_key: dict[str, list[LogRecord]] = defaultdict(list)
    for record in adapter_log:
        key = (record.event.get("payload") or {}).get("idempotency_key")
        if key:
            by_key[key].append(record)
    counts = {"ok": 0, "fail": 0, "unknown": 0, "unknown_committed": 0}
    attempts: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for op in ops:  # a client that retries sends the same key again: one write
        if op["f"] in ("publish", "switch", "purge"):
            attempts[op["args"]["key"]].append(op)
    for key, tries in attempts.items():
        outcomes = {t["outcome"] or "unknown" for t in tries}  # never completed: unknown
        outcome = "ok" if "ok" in outcomes else "unknown" if "unknown" in outcomes else "fail"
        op = next((t for t in tries if t["outcome"] == outcome), tries[-1])
        found = by_key.get(key, [])
        counts[outcome] += 1
        what = f"{op['f']} {op['args'].get('adapter') or op['args'].get('tenant')} key {key}"
        if outcome == "ok":
            if not found:
                report.add("writes", f"acknowledged {what} is not in the log (lost)")
            elif len(found) > 1:
                report.add("writes", f"acknowledged {what} is in the log {len(found)} times")
            elif op["f"] == "publish" and \
                    found[0].event["payload"].get("version") != op["result"].get("version"):
                report.add("writes", f"{what} acknowledged as v{op['result'].get('version')}, "
                                     f"logged as v{found[0].event['payload'].get('version')}")
        elif outcome == "fail" and found:
            report.add("writes", f"{what} was reported failed ({op['result']}) but committed "
                                 f"at {found[0].topic}[{found[0].partition}]@{found[0].offset}")
        elif outcome == "unknown":
            if len(found) > 1:
                report.add("writes", f"unknown {what} is in the log {len(found)} times")
            counts["unknown_committed"] += bool(found)
    report.stats["writes"] = counts


# --- 2. linearizability ------------------------------------------------------------------------


State = tuple[int, int | None]
"""(latest version, active version) of one adapter."""


@dataclass(frozen=True)
class LinOp:
    index: int
    f: str
    invoke: float
    complete: float
    """math.inf for an operation whose outcome is unknown."""
    value: Any


def _step(state: State, op: LinOp) -> State | None:
    """The model: the state after `op`, or None when `op` cannot happen in `state`."""
    latest, active = state
    if op.f == "publish":
        return (latest + 1, active) if op.value in (None, latest + 1) else None
    if op.f == "switch":
        if op.value is None or not 1 <= op.value <= latest or op.value == active:
            return None
        return (latest, op.value)
    if op.f == "read":
        return state if op.value == state else None
    raise ValueError(op.f)


def linearizable(ops: list[LinOp], initial: State = (0, None),
                 budget: int = 2_000_000) -> tuple[bool | None, str]:
    """Whether the history is linearizable (None: the search budget ran out).

    Depth-first over which pending operation takes effect next: one may, when every
    operation that completed before its invocation already has; memoised on (the set
    taken effect, the state). Unknown operations complete at infinity and need not take
    effect at all."""
    ops = sorted(ops, key=lambda o: o.invoke)
    required = frozenset(o.index for o in ops if o.complete != math.inf)
    seen: set[tuple[frozenset[int], State]] = set()
    stack: list[tuple[frozenset[int], State]] = [(frozenset(), initial)]
    steps = 0
    deepest: tuple[int, frozenset[int]] = (0, frozenset())
    while stack:
        done, state = stack.pop()
        if required <= done:
            return True, ""
        if (done, state) in seen:
            continue
        seen.add((done, state))
        steps += 1
        if steps > budget:
            return None, f"search budget of {budget} states ran out"
        if len(done) > deepest[0]:
            deepest = (len(done), done)
        pending = [o for o in ops if o.index not in done]
        horizon = min((o.complete for o in pending), default=math.inf)
        for op in pending:
            if op.invoke > horizon:
                break
            after = _step(state, op)
            if after is not None:
                stack.append((done | {op.index}, after))
    stuck = [o for o in ops if o.index not in deepest[1]][:4]
    return False, "no order explains: " + "; ".join(
        f"{o.f}({o.value}) [{o.invoke:.3f}, {o.complete:.3f}]" for o in stuck)


def check_linearizable(ops: list[dict[str, Any]], adapter_log: list[LogRecord],
                       report: Report) -> None:
    per_adapter: dict[str, list[LinOp]] = defaultdict(list)
    stale_reads: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for op in ops:
        adapter = op["args"].get("adapter")
        if op["f"] not in ("publish", "switch", "read") or op["outcome"] is None:
            continue
        if op["outcome"] == "fail":
            continue  # known not to have happened
        unknown = op["outcome"] == "unknown"
        if op["f"] == "read":
            if unknown:
                continue
            value = (op["result"]["latest"], op["result"]["active"])
            if op["result"].get("read") != "linearizable":
                stale_reads[adapter].append(op)
                continue
        elif op["f"] == "publish":
            value = None if unknown else op["result"].get("version")
        else:
            value = op["args"]["version"]
        per_adapter[adapter].append(LinOp(op["id"], op["f"], op["invoke"],
                                          math.inf if unknown else op["complete"], value))
    verdicts = {}
    for adapter, lin_ops in sorted(per_adapter.items()):
        ok, why = linearizable(lin_ops)
        verdicts[adapter] = {"ops": len(lin_ops), "linearizable": ok}
        if ok is False:
            report.add("linearizable", f"{adapter}: {why}")
        elif ok is None:
            report.add("linearizable", f"{adapter}: undecided: {why}")
    # reads not vouched for: a state the log went through (no phantom, no torn state)
    states = _log_states(adapter_log)
    for adapter, reads in stale_reads.items():
        for op in reads:
            value = (op["result"]["latest"], op["result"]["active"])
            if value not in states.get(adapter, {(0, None)}):
                report.add("linearizable", f"{adapter}: read {value} from "
                                           f"{op['result'].get('registry')} is no state "
                                           "the log went through")
    report.stats["linearizable"] = {"adapters": verdicts,
                                    "stale_possible_reads": sum(map(len, stale_reads.values()))}


def _log_states(adapter_log: list[LogRecord]) -> dict[str, set[State]]:
    states: dict[str, set[State]] = defaultdict(lambda: {(0, None)})
    current: dict[str, State] = {}
    for record in sorted(adapter_log, key=lambda r: (r.partition, r.offset)):
        payload = record.event.get("payload") or {}
        adapter = payload.get("adapter_id")
        if adapter is None:
            continue
        latest, active = current.get(adapter, (0, None))
        kind = record.event.get("type")
        if kind == "AdapterVersionPublished":
            latest = payload["version"]
        elif kind in ("AdapterVersionSwitched", "AdapterRolledBack"):
            active = payload["to_version"]
        else:
            continue
        current[adapter] = (latest, active)
        states[adapter].add((latest, active))
    return states


# --- 3. the version wall -----------------------------------------------------------------------


def active_timeline(adapter_log: list[LogRecord]) -> dict[str, list[tuple[float, int]]]:
    """Per adapter, (time, active version) from each switch or rollback, in log order."""
    timeline: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for record in sorted(adapter_log, key=lambda r: (r.partition, r.offset)):
        payload = record.event.get("payload") or {}
        if record.event.get("type") in ("AdapterVersionSwitched", "AdapterRolledBack"):
            timeline[payload["adapter_id"]].append((record.occurred_at, payload["to_version"]))
    return timeline


def check_version_wall(ops: list[dict[str, Any]], adapter_log: list[LogRecord], wall_s: float,
                       report: Report, slack_s: float = 1.0) -> None:
    timeline = active_timeline(adapter_log)
    checked = 0
    worst = 0.0
    for op in ops:
        if op["f"] != "generate" or op["outcome"] != "ok":
            continue
        adapter, version = op["result"]["adapter"], op["result"]["version"]
        changes = timeline.get(adapter, [])
        checked += 1
        became = [t for t, v in changes if v == version]
        if not became:
            report.add("version_wall", f"request {op['id']} served {adapter}@{version}, never "
                                       "an active version in the log")
            continue
        if min(became) > op["complete"]:
            report.add("version_wall", f"request {op['id']} served {adapter}@{version} before "
                                       "the log made it active")
            continue
        # when was `version` last superseded before the request was sent?
        superseded = None
        active = None
        for at, v in changes:
            if at > op["invoke"]:
                break
            if active == version and v != version:
                superseded = at
            elif v == version:
                superseded = None
            active = v
        if superseded is not None:
            late = op["invoke"] - superseded
            worst = max(worst, late)
            if late > wall_s + slack_s:
                report.add("version_wall",
                           f"request {op['id']} (sent {late:.1f}s after {adapter}@{version} "
                           f"was superseded; wall {wall_s:g}s) served it on "
                           f"{op['result']['worker']} via {op['result']['router']}")
    report.stats["version_wall"] = {"requests_checked": checked,
                                    "worst_staleness_s": round(worst, 2), "wall_s": wall_s}


def check_wall_while_writable(ops: list[dict[str, Any]], wall_s: float, lease_slack_s: float,
                              report: Report) -> None:
    """`lease_slack_s`: how late a lease may be on a working registry (an interval and a
    write's deadline, and a second for the worker to read it)."""
    acked = sorted(op["complete"] for op in ops if op["f"] in ("publish", "switch", "purge")
                   and op["outcome"] == "ok")
    window = wall_s - lease_slack_s
    spurious = []
    for op in ops:
        if op["f"] != "generate" or op["outcome"] != "fail" or op["client"] == "direct" \
                or "version wall" not in op["result"].get("error", ""):
            continue
        at = op["invoke"]
        if any(at - window <= c <= at for c in acked):
            spurious.append(op)
    for op in spurious[:5]:
        report.add("version_wall", f"request {op['id']} refused by the wall while writes "
                                   f"were being acknowledged: {op['result']['error'][:160]}")
    if len(spurious) > 5:
        report.add("version_wall", f"... and {len(spurious) - 5} more")


# --- 4. deadlines ------------------------------------------------------------------------------


def check_deadlines(ops: list[dict[str, Any]], report: Report, slack_s: float = 3.0) -> None:
    late = [op for op in ops if op["f"] == "generate" and op["complete"] is not None
            and op["complete"] - op["invoke"] > op["args"]["deadline_s"] + slack_s]
    for op in late[:10]:
        report.add("deadlines", f"request {op['id']} took {op['complete'] - op['invoke']:.1f}s, "
                                f"deadline {op['args']['deadline_s']:g}s ({op['outcome']})")
    if len(late) > 10:
        report.add("deadlines", f"... and {len(late) - 10} more")
    stuck = [op for op in ops if op["f"] == "generate" and op["complete"] is None]
    for op in stuck:
        report.add("deadlines", f"request {op['id']} never completed")


# --- 5. served_by ------------------------------------------------------------------------------


def check_served_by(ops: list[dict[str, Any]], database_url: str, report: Report,
                    wait_s: float = 60.0) -> None:
    wanted = {op["result"]["trace_id"]: op for op in ops
              if op["f"] == "generate" and op["outcome"] == "ok"}
    rows: dict[str, tuple[Any, ...]] = {}
    deadline = time.monotonic() + wait_s
    with psycopg.connect(database_url, autocommit=True) as conn:
        while True:
            missing = [t for t in wanted if t not in rows]
            if missing:
                for row in conn.execute(
                        "SELECT trace_id, worker_id, adapter_id, version, digest_matches "
                        "FROM served_by WHERE trace_id = ANY(%s)", (missing,)):
                    rows[row[0]] = row
            if len(rows) >= len(wanted) or time.monotonic() > deadline:
                break
            time.sleep(1.0)
    for trace_id, op in wanted.items():
        row = rows.get(trace_id)
        result = op["result"]
        if row is None:
            report.add("served_by", f"completed request {op['id']} (trace {trace_id}, "
                                    f"{result['worker']}) is not in served_by")
            continue
        _, worker, adapter, version, digest_ok = row
        if (worker, adapter, version) != (result["worker"], result["adapter"],
                                          result["version"]) or digest_ok is not True:
            report.add("served_by", f"trace {trace_id}: served_by says {worker} "
                                    f"{adapter}@{version} (digest ok {digest_ok}), the client "
                                    f"was told {result['worker']} {result['adapter']}@"
                                    f"{result['version']}")
    report.stats["served_by"] = {"completed": len(wanted), "found": len(rows)}


# --- 6. purges ---------------------------------------------------------------------------------


def check_purges(ops: list[dict[str, Any]], database_url: str, report: Report) -> None:
    purges = [op for op in ops if op["f"] == "purge" and op["outcome"] == "ok"]
    seen = {}
    with psycopg.connect(database_url, autocommit=True) as conn:
        for op in purges:
            purge_id = op["result"]["purge_id"]
            wait_until = op["complete"] + op["args"]["deadline_s"] + 20
            while True:
                row = conn.execute("SELECT status, workers_missing, blobs_erased_at, "
                                   "deadline_at, last_ack_at FROM purge_proofs "
                                   "WHERE purge_id = %s", (purge_id,)).fetchone()
                if row is not None and row[0] != "pending":
                    break
                if time.time() > wait_until:
                    break
                time.sleep(1.0)
            seen[purge_id] = None if row is None else {
                "status": row[0], "workers_missing": row[1],
                "blobs_erased_at": str(row[2]), "deadline_at": str(row[3]),
                "last_ack_at": str(row[4])}
            if row is None:
                report.add("purges", f"purge {purge_id} is not in purge_proofs")
            elif row[0] == "pending":
                report.add("purges", f"purge {purge_id} still pending 20s past its deadline")
            elif row[0] == "missed" and not row[1]:
                report.add("purges", f"purge {purge_id} missed without naming missing workers")
    report.stats["purges"] = seen


# --- 7. the audit chain ------------------------------------------------------------------------


def check_audit_chain(records: Iterable[LogRecord], database_url: str, report: Report,
                      wait_s: float = 60.0) -> None:
    """Rows = the log's records, offset for offset, and the hash chain recomputed.

    A record whose event id an earlier record already carried, byte for byte, is a
    redelivery (a producer that sent an event again: readers are idempotent on event ids,
    by design) and is not stored again; the same id with other bytes is an anomaly."""
    by_partition: dict[tuple[str, int], list[LogRecord]] = defaultdict(list)
    first: dict[str, LogRecord] = {}
    redelivered = 0
    for record in sorted(records, key=lambda r: (r.topic, r.partition, r.offset)):
        event_id = str(record.event.get("event_id"))
        earlier = first.get(event_id)
        if earlier is None:
            first[event_id] = record
            by_partition[(record.topic, record.partition)].append(record)
        elif earlier.value == record.value:
            redelivered += 1
        else:
            report.add("audit_chain", f"event {event_id} is in the log twice with different "
                                      f"bytes: {earlier.topic}[{earlier.partition}]@"
                                      f"{earlier.offset} and {record.topic}[{record.partition}]"
                                      f"@{record.offset}")
    deadline = time.monotonic() + wait_s
    checked = 0
    with psycopg.connect(database_url, autocommit=True) as conn:
        for (topic, partition), logged in sorted(by_partition.items()):
            logged.sort(key=lambda r: r.offset)
            while True:
                rows = conn.execute(
                    'SELECT "offset", event_id, canonical, prev_hash, hash, chain_index '
                    "FROM events WHERE topic = %s AND partition = %s ORDER BY chain_index",
                    (topic, partition)).fetchall()
                if len(rows) >= len(logged) or time.monotonic() > deadline:
                    break
                time.sleep(1.0)
            previous = GENESIS
            for index, row in enumerate(rows):
                offset, _event_id, canonical, prev_hash, digest, chain_index = row
                if chain_index != index:
                    report.add("audit_chain", f"{topic}[{partition}]: chain index {chain_index}"
                                              f" at position {index}")
                if bytes(prev_hash) != previous:
                    report.add("audit_chain", f"{topic}[{partition}]@{offset}: prev_hash does "
                                              "not link to the row before")
                if hashlib.sha256(previous + bytes(canonical)).digest() != bytes(digest):
                    report.add("audit_chain", f"{topic}[{partition}]@{offset}: hash is not "
                                              "SHA-256(prev || canonical)")
                previous = bytes(digest)
            # rows past the last record read were projected from records appended after
            # the log was read (a healed worker flushing what it held): not checked here
            end = logged[-1].offset
            stored = [(r[0], str(r[1])) for r in rows if r[0] <= end]
            expected = [(r.offset, str(r.event.get("event_id"))) for r in logged]
            if stored != expected:
                missing = sorted(set(expected) - set(stored))
                extra = sorted(set(stored) - set(expected))[:3]
                why = {}
                for offset, event_id in missing[:3]:  # what became of it?
                    letter = conn.execute(
                        'SELECT reason FROM dead_letters WHERE topic = %s AND partition = %s '
                        'AND "offset" = %s', (topic, partition, offset)).fetchone()
                    elsewhere = conn.execute(
                        'SELECT topic, partition, "offset" FROM events WHERE event_id = %s',
                        (event_id,)).fetchone()
                    kind = next((r.event.get("type") for r in logged if r.offset == offset),
                                None)
                    why[offset] = (f"{kind}: dead letter: {letter[0][:200]}" if letter else
                                   f"{kind}: stored from {elsewhere}" if elsewhere else
                                   f"{kind}: neither stored nor a dead letter")
                report.add("audit_chain", f"{topic}[{partition}]: {len(stored)} rows for "
                                          f"{len(expected)} records; missing {missing[:3]} "
                                          f"({why}), not in the log {extra}")
            checked += len(rows)
    report.stats["audit_chain"] = {"rows_checked": checked, "redelivered_records": redelivered}


# --- 8. readiness ------------------------------------------------------------------------------


def check_readiness(ops: list[dict[str, Any]], report: Report, bound_s: float,
                    unwritable: list[tuple[str | None, float, float]] = (),  # type: ignore[assignment]
                    leases: dict[str, list[float]] | None = None,
                    commit_slack_s: float = 0.0) -> None:
    """`unwritable`: (registry id or None for every one, start, end) windows in which it
    cannot commit; `leases`: registry id → when each of its leases in the log was decided
    (a commit no client saw, at most `commit_slack_s` later)."""
    probes = [op for op in ops if op["f"] == "ready" and op["outcome"] == "ok"]
    lies = []
    writes = [op for op in ops if op["f"] in ("publish", "switch", "purge")]
    hung = [op for op in writes if op["outcome"] == "unknown" and op["result"].get("registry")
            and op["result"].get("code") in ("unavailable", "timeout")
            and op["result"].get("said") != "committed"]  # committed, only read back late
    acked: dict[str, list[float]] = defaultdict(list)  # registry → its commits' times
    for op in writes:
        if op["outcome"] == "ok" and op["result"].get("registry"):
            acked[op["result"]["registry"]].append(op["complete"])
    for registry, times in (leases or {}).items():
        acked[registry].extend(t + commit_slack_s for t in times)

    def last_commit_before(who: str, at: float) -> float:
        return max((t for t in acked[who] if t < at), default=-math.inf)

    for probe in probes:
        if probe["result"]["status"] != 200:
            continue
        at, who = probe["invoke"], probe["result"]["registry"]
        for op in hung:
            # hung since its invocation, or since the last write that registry did commit
            since = max(op["invoke"], last_commit_before(who, at))
            if op["result"]["registry"] == who and since + bound_s < at < op["complete"]:
                lies.append(f"{who} said ready at {at:.2f} while write {op['id']} hung "
                            f"({at - since:.1f}s after its last known commit)")
                break
        else:
            for registry, start, end in unwritable:
                if registry in (None, who) and start + bound_s < at < end:
                    lies.append(f"{who} said ready at {at:.2f}, {at - start:.1f}s into a "
                                "window where it cannot commit")
                    break
    for lie in lies[:10]:
        report.add("readiness", lie)
    if len(lies) > 10:
        report.add("readiness", f"... and {len(lies) - 10} more")
    report.stats["readiness"] = {"probes": len(probes),
                                 "ready": sum(p["result"]["status"] == 200 for p in probes),
                                 "lies": len(lies), "bound_s": bound_s}


# --- all of it ---------------------------------------------------------------------------------


def check(history: dict[str, Any], *, bootstrap: str, topics: dict[str, str],
          database_url: str, wall_s: float, readiness_bound_s: float, lease_slack_s: float,
          write_timeout_s: float,
          unwritable: list[tuple[str | None, float, float]] = (),  # type: ignore[assignment]
          ) -> Report:
    """`topics`: {"adapter": …, "worker": …, "liveness": …} topic names."""
    ops = history["ops"]
    report = Report()
    adapter_log = read_topic(bootstrap, topics["adapter"])
    worker_log = read_topic(bootstrap, topics["worker"])
    leases: dict[str, list[float]] = defaultdict(list)
    for record in read_topic(bootstrap, topics["liveness"]):
        if record.event.get("type") == "RegistryLease":
            leases[record.event["payload"]["registry_id"]].append(record.occurred_at)
    check_writes(ops, adapter_log, report)
    check_linearizable(ops, adapter_log, report)
    check_version_wall(ops, adapter_log, wall_s, report)
    check_wall_while_writable(ops, wall_s, lease_slack_s, report)
    check_deadlines(ops, report)
    check_readiness(ops, report, readiness_bound_s, unwritable, leases, write_timeout_s)
    check_served_by(ops, database_url, report)
    check_purges(ops, database_url, report)
    check_audit_chain([*adapter_log, *worker_log], database_url, report)
    return report
