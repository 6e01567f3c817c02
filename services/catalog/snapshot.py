"""`CatalogState` as a versioned JSON document, and the fold a log follower drives.

The document is written field by field (no pickle of live objects), so a snapshot stays
readable by the next release unless `FOLD_VERSION` says otherwise: bump it whenever the
document's layout or the fold's rules change (`CatalogState.apply`, `FOLDED_TYPES`), and
every follower then ignores older snapshots and replays the log instead.

Events inside the state (a version's publish payload, the event an Idempotency-Key
answered with) are kept as their JSON documents and rebuilt only when something reads
them: a reader restores thousands of versions and reads few.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from services.catalog.purge import PurgeAck
from services.catalog.state import (
    FOLDED_TYPES,
    Adapter,
    AdapterVersion,
    Alias,
    BaseModel,
    CatalogState,
    GateState,
    IdempotentAnswer,
    Lease,
    LogPosition,
    Purge,
    Rollout,
    RolloutFact,
)
from services.contracts.events import (
    GateRequest,
    Judgement,
    QualityGateCompleted,
    QualityGateExpired,
    RolloutPlan,
    RolloutStep,
    SplitEntry,
    TenantBlobsDeleted,
    TenantRef,
)
from services.eventlog.consumer import Record

FOLD_VERSION = "catalog/5"
"""catalog/1 was the fold before snapshots existed; catalog/2 lacked release state;
catalog/3 lacked the blob erasure of purges (TenantBlobsDeleted); catalog/4 lacked the
versions a purge ended (`purged_by`) and when a purge's blobs were erased."""

Document = dict[str, Any]


def _time(value: datetime) -> str:
    return value.isoformat()


def _tenant(tenant: TenantRef | None) -> Document | None:
    return tenant.model_dump() if tenant is not None else None


def _tenant_of(doc: Document | None) -> TenantRef | None:
    return TenantRef.model_validate(doc) if doc is not None else None


def _position(position: LogPosition | None) -> list[Any] | None:
    return [position.topic, position.partition, position.offset] if position else None


def _position_of(doc: list[Any] | None) -> LogPosition | None:
    return LogPosition(str(doc[0]), int(doc[1]), int(doc[2])) if doc else None


def _ack(ack: PurgeAck) -> Document:
    return {"worker_id": ack.worker_id, "acked_at": _time(ack.acked_at),
            "kv_blocks_freed": ack.kv_blocks_freed, "adapters_unloaded": ack.adapters_unloaded,
            "sequences_aborted": ack.sequences_aborted, "refcounts_zero": ack.refcounts_zero}


def _ack_of(doc: Document) -> PurgeAck:
    return PurgeAck(doc["worker_id"], datetime.fromisoformat(doc["acked_at"]),
                    doc["kv_blocks_freed"], doc["adapters_unloaded"], doc["sequences_aborted"],
                    doc["refcounts_zero"])


def _model(value: Any) -> Document | None:
    return value.model_dump(mode="json") if value is not None else None


def _timed(item: tuple[datetime, Any] | None) -> list[Any] | None:
    return [_time(item[0]), item[1].model_dump(mode="json")] if item is not None else None


def _gate(gate: GateState | None) -> Document | None:
    if gate is None:
        return None
    return {"request": gate.request.model_dump(mode="json"),
            "requested_at": _time(gate.requested_at), "requested_by": gate.requested_by,
            "event_id": gate.event_id, "results": [_timed(r) for r in gate.results],
            "expiry": _timed(gate.expiry)}


def _gate_of(doc: Document | None) -> GateState | None:
    if doc is None:
        return None
    expiry = doc["expiry"]
    return GateState(GateRequest.model_validate(doc["request"]),
                     datetime.fromisoformat(doc["requested_at"]), doc["requested_by"],
                     doc["event_id"], [_result_of(r) for r in doc["results"]],
                     None if expiry is None else (datetime.fromisoformat(expiry[0]),
                                                  QualityGateExpired.model_validate(expiry[1])))


def _result_of(doc: list[Any]) -> tuple[datetime, QualityGateCompleted]:
    return datetime.fromisoformat(doc[0]), QualityGateCompleted.model_validate(doc[1])


def _rollout(r: Rollout) -> Document:
    return {
        "rollout_id": r.rollout_id, "alias": r.alias, "adapter_id": r.adapter_id,
        "canary_version": r.canary_version, "baseline_version": r.baseline_version,
        "plan": r.plan.model_dump(mode="json"), "tenant": _tenant(r.tenant),
        "started_at": _time(r.started_at), "stage": r.stage,
        "stage_started_at": _time(r.stage_started_at) if r.stage_started_at else None,
        "status": r.status, "status_reason": r.status_reason,
        "last_judgement": _model(r.last_judgement),
        "steps": [[_time(at), action, actor] for at, action, actor in r.steps],
        "facts": [{"at": _time(f.at), "action": f.action, "actor": f.actor,
                   "step": _model(f.step), "reason": f.reason, "judgement": _model(f.judgement)}
                  for f in r.facts]}


def _rollout_of(d: Document) -> Rollout:
    def judgement(doc: Document | None) -> Judgement | None:
        return Judgement.model_validate(doc) if doc is not None else None

    return Rollout(
        d["rollout_id"], d["alias"], d["adapter_id"], d["canary_version"],
        d["baseline_version"], RolloutPlan.model_validate(d["plan"]), _tenant_of(d["tenant"]),
        datetime.fromisoformat(d["started_at"]), d["stage"],
        datetime.fromisoformat(d["stage_started_at"]) if d["stage_started_at"] else None,
        d["status"], d["status_reason"], judgement(d["last_judgement"]),
        [(datetime.fromisoformat(at), action, actor) for at, action, actor in d["steps"]],
        [RolloutFact(datetime.fromisoformat(f["at"]), f["action"], f["actor"],
                     RolloutStep.model_validate(f["step"]) if f["step"] else None,
                     f["reason"], judgement(f["judgement"])) for f in d["facts"]])


def dump_state(state: CatalogState) -> Document:
    """The state as JSON-ready data that shares nothing mutable with it."""
    return {
        "stale_after_s": state.stale_after_s,
        "base_models": [
            {"name": m.name, "digest": m.digest, "config": m.config,
             "registered_at": _time(m.registered_at), "seq": m.seq}
            for m in state.base_models.values()],
        "adapters": [
            {"adapter_id": a.adapter_id, "tenant": _tenant(a.tenant), "seq": a.seq,
             "active_version": a.active_version,
             "versions": [
                 {"published": v.published_document(),
                  "published_at": _time(v.published_at), "event_id": v.event_id,
                  "position": _position(v.position), "disabled": v.disabled,
                  "disabled_reason": v.disabled_reason, "ever_active": v.ever_active,
                  "rolled_back": v.rolled_back, "seq": v.seq, "gate": _gate(v.gate),
                  "override": None if v.override is None else [
                      _time(v.override[0]), v.override[1], v.override[2]],
                  "canary_rollback": None if v.canary_rollback is None else [
                      _time(v.canary_rollback[0]), v.canary_rollback[1]],
                  "purged_by": v.purged_by}
                 for v in a.versions.values()]}
            for a in state.adapters.values()],
        "aliases": [
            {"alias": a.alias, "tenant": _tenant(a.tenant), "seq": a.seq,
             "split": [e.model_dump() for e in a.split], "changed_at": _time(a.changed_at)}
            for a in state.aliases.values()],
        "purges": [
            {"purge_id": p.purge_id, "tenant": _tenant(p.tenant), "deadline_s": p.deadline_s,
             "hard": p.hard, "requested_at": _time(p.requested_at),
             "expected_workers": list(p.expected_workers), "acks": [_ack(a) for a in p.acks],
             "blobs": _model(p.blobs),
             "erased_at": _time(p.erased_at) if p.erased_at else None}
            for p in state.purges.values()],
        "early_acks": {purge_id: [_ack(a) for a in acks]
                       for purge_id, acks in state.early_acks.items()},
        "tenant_seqs": dict(state.tenant_seqs),
        "idempotency": [
            {"actor": actor, "key": key, "event": answer.document,
             "position": _position(answer.position)}
            for (actor, key), answer in state.idempotency.items()],
        "heartbeats": {worker: _time(at) for worker, at in state.heartbeats.items()},
        "worker_bases": dict(state.worker_bases),
        "worker_weights": dict(state.worker_weights),
        "merged_workers": dict(state.merged_workers),
        "gates": {gate_id: list(where) for gate_id, where in state.gates.items()},
        "orphan_results": {gate_id: [_timed(r) for r in results]
                           for gate_id, results in state.orphan_results.items()},
        "rollouts_by_id": [_rollout(r) for r in state.rollouts_by_id.values()],
        "rollouts": {alias: r.rollout_id for alias, r in state.rollouts.items()},
        "lease": None if state.lease is None else {
            "registry_id": state.lease.registry_id, "epoch": state.lease.epoch,
            "expires_at": _time(state.lease.expires_at), "seq": state.lease.seq},
    }


def load_state(doc: Document) -> CatalogState:
    """The inverse of `dump_state`; raises KeyError / ValueError on a malformed document."""
    state = CatalogState(stale_after_s=float(doc["stale_after_s"]))
    for m in doc["base_models"]:
        state.base_models[m["name"]] = BaseModel(
            m["name"], m["digest"], dict(m["config"]), datetime.fromisoformat(m["registered_at"]),
            m["seq"])
    for a in doc["adapters"]:
        adapter = state.adapters[a["adapter_id"]] = Adapter(
            a["adapter_id"], _tenant_of(a["tenant"]), a["seq"],
            active_version=a["active_version"])
        for v in a["versions"]:
            adapter.versions[int(v["published"]["version"])] = AdapterVersion(
                datetime.fromisoformat(v["published_at"]), v["event_id"],
                _position_of(v["position"]), v["disabled"], v["disabled_reason"],
                v["ever_active"], v["rolled_back"], v["seq"], gate=_gate_of(v["gate"]),
                override=None if v["override"] is None else (
                    datetime.fromisoformat(v["override"][0]), v["override"][1],
                    v["override"][2]),
                canary_rollback=None if v["canary_rollback"] is None else (
                    datetime.fromisoformat(v["canary_rollback"][0]), v["canary_rollback"][1]),
                purged_by=v["purged_by"], published_json=v["published"])
    for a in doc["aliases"]:
        state.aliases[a["alias"]] = Alias(
            a["alias"], _tenant_of(a["tenant"]), a["seq"],
            tuple(SplitEntry.model_validate(e) for e in a["split"]),
            datetime.fromisoformat(a["changed_at"]))
    for p in doc["purges"]:
        state.purges[p["purge_id"]] = Purge(
            p["purge_id"], _tenant_of(p["tenant"]), p["deadline_s"], p["hard"],
            datetime.fromisoformat(p["requested_at"]), tuple(p["expected_workers"]),
            [_ack_of(a) for a in p["acks"]],
            None if p["blobs"] is None else TenantBlobsDeleted.model_validate(p["blobs"]),
            datetime.fromisoformat(p["erased_at"]) if p["erased_at"] else None)
    state.early_acks = {purge_id: [_ack_of(a) for a in acks]
                        for purge_id, acks in doc["early_acks"].items()}
    state.tenant_seqs = {k: int(v) for k, v in doc["tenant_seqs"].items()}
    for entry in doc["idempotency"]:
        state.idempotency[(entry["actor"], entry["key"])] = IdempotentAnswer(
            None, _position_of(entry["position"]), document=entry["event"])
    state.heartbeats = {w: datetime.fromisoformat(at) for w, at in doc["heartbeats"].items()}
    state.worker_bases = dict(doc["worker_bases"])
    state.worker_weights = dict(doc.get("worker_weights", {}))
    state.merged_workers = dict(doc.get("merged_workers", {}))
    state.gates = {gate_id: (where[0], int(where[1])) for gate_id, where in doc["gates"].items()}
    state.orphan_results = {gate_id: [_result_of(r) for r in results]
                            for gate_id, results in doc["orphan_results"].items()}
    state.rollouts_by_id = {r["rollout_id"]: _rollout_of(r) for r in doc["rollouts_by_id"]}
    state.rollouts = {alias: state.rollouts_by_id[rollout_id]
                      for alias, rollout_id in doc["rollouts"].items()}
    lease = doc["lease"]
    if lease is not None:
        state.lease = Lease(lease["registry_id"], lease["epoch"],
                            datetime.fromisoformat(lease["expires_at"]), lease["seq"])
    return state


class CatalogFold:
    """`CatalogState` as a log follower's fold (`services.eventlog.follower.Fold`)."""

    fold_version = FOLD_VERSION
    wanted_types = FOLDED_TYPES

    def __init__(self, stale_after_s: float = 30.0,
                 on_folded: Callable[[Record], None] | None = None) -> None:
        self.stale_after_s = stale_after_s
        self.state = CatalogState(stale_after_s=stale_after_s)
        self._on_folded = on_folded

    def apply(self, record: Record) -> None:
        self.state.apply(record.envelope,
                         LogPosition(record.topic, record.partition, record.offset))
        if self._on_folded is not None:
            self._on_folded(record)

    def dump(self) -> Document:
        return dump_state(self.state)

    def load(self, document: Document | None) -> None:
        if document is None:
            self.state = CatalogState(stale_after_s=self.stale_after_s)
            return
        state = load_state(document)
        state.stale_after_s = self.stale_after_s  # the setting, not the snapshot's
        self.state = state
