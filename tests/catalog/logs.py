"""Hypothesis strategy for catalog logs: events across the three topics, as a broker would
hold them (each in the partition of its stream, in order there)."""

from __future__ import annotations

import zlib
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from hypothesis import strategies as st

from services.contracts.events import (
    AdapterDisabled,
    AdapterEnabled,
    AdapterRolledBack,
    AdapterVersionPublished,
    AdapterVersionSwitched,
    BaseModelRegistered,
    Envelope,
    GateRequest,
    Payload,
    QualityGateCompleted,
    QualityGateExpired,
    QualityGateRequested,
    RegistryLease,
    ReleaseOverridden,
    RolloutHalted,
    RolloutPlan,
    RolloutResumed,
    RolloutStep,
    SplitEntry,
    TenantBlobsDeleted,
    TenantPurged,
    TenantPurgeRequested,
    TenantRef,
    TrafficSplitChanged,
    WorkerHeartbeat,
)

PARTITIONS = 3
TENANTS = [TenantRef(org="acme", team="a", project="p"), TenantRef(org="globex", team="b",
                                                                  project="q")]
WORKERS = ["w0", "w1", "w2"]
DIGEST = "ab" * 32


@dataclass(frozen=True)
class Placed:
    topic: str
    partition: int
    offset: int
    envelope: Envelope


OPS = ["base", "publish", "switch", "rollback", "disable", "enable", "split", "purge", "ack",
       "heartbeat", "lease", "gate", "gate_done", "gate_expired", "override", "rollout",
       "rollout_done", "halt", "resume"]
PLAN = RolloutPlan(stages=[10, 50, 100], min_stage_s=1, window_s=1, max_error_ratio=2,
                   min_requests=1, max_p95_ms=100)


@st.composite
def catalog_logs(draw: st.DrawFn, max_ops: int = 40, kinds: list[str] = OPS, spread: int = 3
                 ) -> dict[tuple[str, int], list[Placed]]:
    """Partition → its events in log order. Timestamps may repeat (ties must not matter).
    `kinds`: the operations drawn from (a list with repeats weighs some more); `spread`:
    how many adapters, aliases and versions the operations pick among (at most 3)."""
    ops = draw(st.lists(st.tuples(st.sampled_from(kinds), st.integers(0, spread - 1),
                                  st.integers(1, spread),
                                  st.booleans(), st.sampled_from([None, "k1", "k2"])),
                        min_size=1, max_size=max_ops))
    clock = datetime(2026, 1, 1, tzinfo=UTC)
    seqs: dict[str, int] = defaultdict(int)
    purges: list[str] = []
    gates: list[tuple[str, str, int]] = []
    rollouts: dict[int, tuple[str, int]] = {}
    """alias index → (its current rollout id, stage)."""
    partitions: dict[tuple[str, int], list[Placed]] = defaultdict(list)

    def place(topic: str, payload: Payload, stream: str, actor: str,
              tenant: TenantRef | None = None) -> None:
        seqs[stream] += 1
        envelope = Envelope.new(payload, stream=stream, seq=seqs[stream], actor=actor,
                                tenant=tenant, occurred_at=clock)
        key = (topic, zlib.crc32(stream.encode()) % PARTITIONS)
        partitions[key].append(Placed(key[0], key[1], len(partitions[key]), envelope))

    for op, i, n, flag, idem in ops:
        clock += timedelta(milliseconds=draw(st.integers(0, 3)))
        adapter, tenant = f"bot{i}", TENANTS[i % 2]
        keyed = {"idempotency_key": idem}
        if op == "base":
            place("adapter", BaseModelRegistered(name=f"base{i}", digest=DIGEST,
                                                 config={"n": n}, **keyed),
                  f"base-model/base{i}", "admin")
        elif op == "publish":
            place("adapter", AdapterVersionPublished(
                adapter_id=adapter, version=n, label=f"v{n}", base_model="base0",
                base_model_digest=DIGEST, sha256=DIGEST, config_sha256=DIGEST,
                size_bytes=10 * n, rank=4, lora_alpha=8.0, target_modules=["q_proj"],
                dtype="float16", owner="o", rollback_to=1 if flag and n > 1 else None,
                **keyed), f"adapter/{adapter}", "alice", tenant)
        elif op in ("switch", "rollback"):
            payload: Payload = (
                AdapterVersionSwitched(adapter_id=adapter, from_version=None, to_version=n,
                                       **keyed) if op == "switch" else
                AdapterRolledBack(adapter_id=adapter, from_version=n, to_version=1,
                                  reason="r", **keyed))
            place("adapter", payload, f"adapter/{adapter}", "alice", tenant)
        elif op in ("disable", "enable"):
            cls = AdapterDisabled if op == "disable" else AdapterEnabled
            place("adapter", cls(adapter_id=adapter, version=n, reason="x", **keyed),
                  f"adapter/{adapter}", "alice", tenant)
        elif op == "split":
            entries = [SplitEntry(adapter_id=adapter, version=n, weight=60 if flag else 100)]
            if flag:
                entries.append(SplitEntry(adapter_id=adapter, version=1, weight=40))
            place("adapter", TrafficSplitChanged(alias=f"alias{i}", split=entries, **keyed),
                  f"alias/alias{i}", "alice", tenant)
        elif op == "purge":
            purge_id = f"p{len(purges)}"
            purges.append(purge_id)
            place("adapter", TenantPurgeRequested(purge_id=purge_id, deadline_s=float(n),
                                                  expected_workers=WORKERS[:n], **keyed),
                  f"tenant/{tenant.key}", "alice", tenant)
            if flag:  # the registry erased its blobs
                place("adapter", TenantBlobsDeleted(purge_id=purge_id, deleted=[DIGEST]),
                      f"tenant/{tenant.key}", "registry/erasure", tenant)
        elif op == "ack":
            purge_id = purges[i % len(purges)] if purges else "p-unknown"
            worker = WORKERS[n - 1]
            place("worker", TenantPurged(worker_id=worker, purge_id=purge_id,
                                         kv_blocks_freed=n, adapters_unloaded=i,
                                         refcounts_zero=flag),
                  f"worker/{worker}", worker)
        elif op == "heartbeat":
            worker = WORKERS[i]
            place("liveness", WorkerHeartbeat(worker_id=worker, address="a", base_model="b",
                                              base_model_digest=DIGEST, free_slots=n),
                  f"heartbeat/{worker}", worker)
        elif op == "lease":
            place("liveness", RegistryLease(registry_id=f"r{i}", epoch=n,
                                            expires_at=clock + timedelta(seconds=5)),
                  "registry/lease", f"r{i}")
        elif op == "gate":
            gate_id = f"g{len(gates)}"
            gates.append((gate_id, adapter, n))
            place("adapter", QualityGateRequested(
                adapter_id=adapter, version=n, gate=GateRequest(
                    gate_id=gate_id, regression_set_sha256=DIGEST, cases=2,
                    worker_id=WORKERS[i], timeout_s=60), **keyed),
                  f"adapter/{adapter}", "admin", tenant)
        elif op in ("gate_done", "gate_expired") and gates:
            gate_id, gated, version = gates[(i + n) % len(gates)]
            if op == "gate_done":
                place("worker", QualityGateCompleted(
                    worker_id=WORKERS[i], gate_id=gate_id, adapter_id=gated, version=version,
                    base_model_digest=DIGEST, regression_set_sha256=DIGEST,
                    adapter_sha256=DIGEST, passed=flag), f"worker/{WORKERS[i]}", WORKERS[i])
            else:
                place("adapter", QualityGateExpired(
                    adapter_id=gated, version=version, gate_id=gate_id, cause="timeout",
                    reason="late"), f"adapter/{gated}", "registry", tenant)
        elif op == "override":
            place("adapter", ReleaseOverridden(adapter_id=adapter, version=n, reason="ok",
                                               **keyed), f"adapter/{adapter}", "admin", tenant)
        elif op in ("rollout", "rollout_done"):
            current = rollouts.get(i)
            stage = current[1] + 1 if current else 0
            done = op == "rollout_done" or stage >= len(PLAN.stages) - 1
            rollout_id = current[0] if current else f"ro{i}-{len(partitions)}-{n}"
            action = ("completed" if done and current else "rolled_back" if flag and current
                      else "advanced" if current else "started")
            step = RolloutStep(rollout_id=rollout_id, action=action, alias=f"alias{i}",
                               adapter_id=adapter, canary_version=n, baseline_version=1,
                               stage=min(stage, len(PLAN.stages) - 1),
                               weight=PLAN.stages[min(stage, len(PLAN.stages) - 1)],
                               plan=PLAN, reason=action)
            if action == "completed":
                rollouts.pop(i)
                place("adapter", AdapterVersionSwitched(
                    adapter_id=adapter, from_version=1, to_version=n, alias=f"alias{i}",
                    rollout=step), f"adapter/{adapter}", "controller", tenant)
            else:
                rollouts[i] = (rollout_id, step.stage)
                if action == "rolled_back":
                    rollouts.pop(i)
                place("adapter", TrafficSplitChanged(alias=f"alias{i}", split=[
                    SplitEntry(adapter_id=adapter, version=n, weight=100)], rollout=step),
                      f"alias/alias{i}", "controller", tenant)
        elif op in ("halt", "resume") and i in rollouts:
            rollout_id, stage = rollouts[i]
            payload = (RolloutHalted(alias=f"alias{i}", rollout_id=rollout_id, stage=stage,
                                     reason="slow") if op == "halt" else
                       RolloutResumed(alias=f"alias{i}", rollout_id=rollout_id, stage=stage))
            place("adapter", payload, f"alias/alias{i}", "controller", tenant)
    return dict(partitions)


def interleave(partitions: dict[tuple[str, int], list[Placed]], choices: list[int]
               ) -> list[Placed]:
    """One order a reader could read them in: any mix of partitions, order within each."""
    queues = {key: list(events) for key, events in sorted(partitions.items())}
    merged: list[Placed] = []
    pick = iter(choices)
    while queues:
        keys = sorted(queues)
        key = keys[next(pick, 0) % len(keys)]
        merged.append(queues[key].pop(0))
        if not queues[key]:
            del queues[key]
    return merged
