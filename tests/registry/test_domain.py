"""The pure aggregate: folds, commands, rollback lineage, replay determinism (no I/O)."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.catalog.state import (
    CatalogState,
    LogPosition,
    Refusal,
    rollback_candidates,
    rollback_target,
)
from services.contracts.events import (
    Envelope,
    SplitEntry,
    TenantBlobsDeleted,
    TenantPurged,
    TenantRef,
    WorkerHeartbeat,
)
from services.registry.domain import (
    ArtifactFacts,
    CommandEvent,
    PublishRequest,
    register_base_model,
    request_purge,
    roll_back,
    set_disabled,
    set_split,
    switch_active,
)
from services.registry.domain import publish_version as publish_cmd

TENANT = TenantRef(org="acme", team="search", project="prod")
DIGEST = "a" * 64
_offsets = itertools.count()


Log = list[tuple[Envelope, LogPosition]]


def commit(state: CatalogState, decision: CommandEvent, actor: str = "admin:x",
           at: datetime | None = None, log: Log | None = None) -> Envelope:
    envelope = Envelope.new(decision.payload, stream=decision.stream, seq=decision.seq,
                            actor=actor, tenant=decision.tenant, occurred_at=at)
    position = LogPosition("t", 0, next(_offsets))
    state.apply(envelope, position)
    if log is not None:
        log.append((envelope, position))
    return envelope


def facts(n: int) -> ArtifactFacts:
    return ArtifactFacts(f"{n:064x}", DIGEST, 10, 4, 8.0, ("q_proj",), "float16")


def with_versions(count: int, log: Log | None = None) -> CatalogState:
    state = CatalogState()
    commit(state, register_base_model(state, "llama", DIGEST, {"hidden_size": 64}), log=log)
    for n in range(1, count + 1):
        commit(state, publish_cmd(state, PublishRequest("bot", TENANT, "o", "llama", f"v{n}"),
                                  facts(n)), log=log)
    return state


def test_publish_numbers_versions_and_refuses_duplicates() -> None:
    state = with_versions(2)
    bot = state.adapter("bot")
    assert sorted(bot.versions) == [1, 2] and bot.seq == 2 and bot.active_version is None
    request = PublishRequest("bot", TENANT, "o", "llama", "v1")
    with pytest.raises(Refusal) as dup:
        publish_cmd(state, request, facts(9))
    assert dup.value.kind == "conflict"
    with pytest.raises(Refusal) as stale:
        publish_cmd(state, PublishRequest("bot", TENANT, "o", "llama", "v3"), facts(3),
                    expected=1)
    assert stale.value.kind == "precondition"
    with pytest.raises(Refusal) as unknown:
        publish_cmd(state, PublishRequest("bot", TENANT, "o", "nope", "v3"), facts(3))
    assert unknown.value.kind == "invalid"
    other = TenantRef(org="rival", team="x", project="y")
    with pytest.raises(Refusal) as foreign:
        publish_cmd(state, PublishRequest("bot", other, "o", "llama", "v3"), facts(3))
    # answered as taken (a conflict) naming no tenant; the real reason kept for the log
    answer = foreign.value.public()
    assert (foreign.value.kind, answer.kind) == ("forbidden", "conflict")
    assert "acme" not in answer.message and "acme" in foreign.value.message


def test_rollback_goes_to_previous_stable_version() -> None:
    state = with_versions(4)
    commit(state, switch_active(state, "bot", 1))
    # splits never make a version stable, not even 100% of an alias: only a switch does
    commit(state, set_split(state, "prod", [SplitEntry(adapter_id="bot", version=2, weight=5),
                                            SplitEntry(adapter_id="bot", version=1,
                                                       weight=95)]))
    commit(state, set_split(state, "prod", [SplitEntry(adapter_id="bot", version=2,
                                                       weight=100)]))
    commit(state, switch_active(state, "bot", 3))
    commit(state, switch_active(state, "bot", 4))
    bot = state.adapter("bot")
    assert rollback_candidates(bot) == [3, 1] and rollback_target(bot) == 3
    commit(state, set_disabled(state, "bot", 3, True, "bad"))
    assert rollback_target(state.adapter("bot")) == 1
    event = commit(state, roll_back(state, "bot", None, "errors"))
    assert (event.payload.from_version, event.payload.to_version) == (4, 1)
    assert state.adapter("bot").active_version == 1
    with pytest.raises(Refusal) as nothing:
        roll_back(state, "bot", None, "again")
    assert nothing.value.kind == "conflict"


def test_declared_rollback_to_wins_when_enabled() -> None:
    state = with_versions(2)
    commit(state, switch_active(state, "bot", 2))
    commit(state, publish_cmd(state, PublishRequest("bot", TENANT, "o", "llama", "v3",
                                                    rollback_to=1), facts(3)))
    commit(state, switch_active(state, "bot", 3))
    assert rollback_target(state.adapter("bot")) == 1
    commit(state, set_disabled(state, "bot", 1, True, "x"))
    assert rollback_target(state.adapter("bot")) == 2


@pytest.mark.parametrize(("split", "kind"), [
    ([("bot", 1, 50)], "invalid"),
    ([("bot", 1, 50), ("bot", 1, 50)], "invalid"),
    ([("bot", 9, 100)], "invalid"),
    ([("bot", 2, 100)], "conflict"),  # disabled
])
def test_split_refusals(split: list[tuple[str, int, int]], kind: str) -> None:
    state = with_versions(2)
    commit(state, set_disabled(state, "bot", 2, True, "x"))
    entries = [SplitEntry(adapter_id=a, version=v, weight=w) for a, v, w in split]
    with pytest.raises(Refusal) as refused:
        set_split(state, "prod", entries)
    assert refused.value.kind == kind


def test_purge_status_from_heartbeats_and_acks() -> None:
    state = CatalogState(stale_after_s=30)
    t0 = datetime(2030, 1, 1, tzinfo=UTC)
    # "late" beats after the decision time: not live then, whatever order it is read in
    for worker, age in (("w1", 5), ("w2", 10), ("old", 120), ("late", -60)):
        state.apply(Envelope.new(WorkerHeartbeat(worker_id=worker, address="a", base_model="m",
                                                 base_model_digest=DIGEST),
                                 stream=f"worker/{worker}", seq=1, actor=worker,
                                 occurred_at=t0 - timedelta(seconds=age)))
    commit(state, request_purge(state, TENANT, "p1", 60, now=t0), at=t0)
    purge = state.purges["p1"]
    assert purge.expected_workers == ("w1", "w2") and purge.status(t0) == "pending"

    def ack(worker: str, delay: int, refcounts_zero: bool = True) -> None:
        state.apply(Envelope.new(TenantPurged(worker_id=worker, purge_id="p1",
                                              kv_blocks_freed=1, adapters_unloaded=0,
                                              refcounts_zero=refcounts_zero),
                                 stream=f"worker/{worker}", seq=2, actor=worker,
                                 occurred_at=t0 + timedelta(seconds=delay)))

    ack("w1", 5, refcounts_zero=False)  # references still held: does not count
    ack("w2", 10)
    assert purge.status(t0 + timedelta(seconds=30)) == "pending"
    ack("w1", 20)  # a later ack with refcounts at zero counts, not only the first
    assert purge.status(t0 + timedelta(seconds=30)) == "pending"  # the blobs are still there
    erase(state, "p1", t0 + timedelta(seconds=25))
    assert purge.status(t0 + timedelta(seconds=30)) == "met"
    ack("w1", 90)  # late acks never undo a met purge
    assert purge.status(t0 + timedelta(seconds=100)) == "met"
    assert state.tenant_seqs["tenant/acme/search/prod"] == 2


def erase(state: CatalogState, purge_id: str, at: datetime) -> None:
    """The registry's erasure of a purge's blobs, recorded at `at`."""
    stream = "tenant/acme/search/prod"
    state.apply(Envelope.new(TenantBlobsDeleted(purge_id=purge_id), stream=stream,
                             seq=state.tenant_seqs[stream] + 1, actor="registry/erasure",
                             tenant=TENANT, occurred_at=at))


def test_purge_missed_when_its_blobs_are_erased_late() -> None:
    """Every expected worker acked in time, but the erasure came after the deadline."""
    state = CatalogState(stale_after_s=30)
    t0 = datetime(2030, 1, 1, tzinfo=UTC)
    commit(state, request_purge(state, TENANT, "p1", 60, now=t0), at=t0)
    assert state.purges["p1"].expected_workers == ()
    assert state.purges["p1"].status(t0 + timedelta(seconds=61)) == "missed"
    erase(state, "p1", t0 + timedelta(seconds=61))
    assert state.purges["p1"].status(t0 + timedelta(seconds=62)) == "missed"


def test_purge_missed_when_an_expected_worker_acks_late() -> None:
    state = CatalogState(stale_after_s=30)
    t0 = datetime(2030, 1, 1, tzinfo=UTC)
    state.apply(Envelope.new(WorkerHeartbeat(worker_id="w1", address="a", base_model="m",
                                             base_model_digest=DIGEST),
                             stream="worker/w1", seq=1, actor="w1", occurred_at=t0))
    commit(state, request_purge(state, TENANT, "p1", 60, now=t0), at=t0)
    state.apply(Envelope.new(TenantPurged(worker_id="w1", purge_id="p1", kv_blocks_freed=1,
                                          adapters_unloaded=0, refcounts_zero=True),
                             stream="worker/w1", seq=2, actor="w1",
                             occurred_at=t0 + timedelta(seconds=61)))
    assert state.purges["p1"].status(t0 + timedelta(seconds=61)) == "missed"


def test_idempotency_key_is_scoped_to_actor_and_request() -> None:
    state = with_versions(1)
    decision = switch_active(state, "bot", 1, idempotency_key="k")
    commit(state, decision, actor="publisher:abc")
    assert state.prior_answer("publisher:abc", "k", "AdapterVersionSwitched", "adapter/bot")
    assert state.prior_answer("publisher:other", "k", "AdapterVersionSwitched",
                              "adapter/bot") is None
    with pytest.raises(Refusal):
        state.prior_answer("publisher:abc", "k", "AdapterRolledBack", "adapter/bot")


# --- replay determinism: random command sequences, then a fresh fold of their events ---

command = st.tuples(st.sampled_from(["publish", "switch", "rollback", "disable", "enable",
                                     "split", "purge"]),
                    st.integers(1, 5), st.integers(0, 100))


@settings(max_examples=150, deadline=None)
@given(st.lists(command, max_size=40))
def test_folding_the_events_again_gives_the_same_state(commands: list) -> None:
    log: Log = []
    state = with_versions(1, log)
    for kind, n, w in commands:
        try:
            if kind == "publish":
                decision = publish_cmd(state, PublishRequest("bot", TENANT, "o", "llama",
                                                             f"l{len(log)}"), facts(len(log)))
            elif kind == "switch":
                decision = switch_active(state, "bot", n)
            elif kind == "rollback":
                decision = roll_back(state, "bot", None, "r")
            elif kind in ("disable", "enable"):
                decision = set_disabled(state, "bot", n, kind == "disable", "r")
            elif kind == "split":
                decision = set_split(state, "prod", [
                    SplitEntry(adapter_id="bot", version=1, weight=w),
                    SplitEntry(adapter_id="bot", version=n, weight=100 - w)])
            else:
                decision = request_purge(state, TENANT, f"p{len(log)}", 60)
        except Refusal:
            continue
        commit(state, decision, actor="publisher:abc", log=log)
    replayed = CatalogState()
    seen = {e.event_id for e, _ in log}
    for envelope, position in log:
        replayed.apply(envelope, position)
    assert replayed == state
    by_stream: dict[str, list[int]] = {}
    for envelope, _ in log:
        by_stream.setdefault(envelope.stream, []).append(envelope.seq)
    adapter_seqs = by_stream.get("adapter/bot", [])
    assert adapter_seqs == list(range(1, 1 + len(adapter_seqs)))  # gap-free
    assert len(seen) == len(log)
