"""The operator's deploy of one adapter version: publish, wait for its quality gate, then
walk a canary through its stages (5 → 25 → 50 → 100 by default) on the adapter's alias,
as the canary controller judges it, until it completes or is rolled back.

Only the registry's REST routes: the registry decides, the canary controller judges and
steps, and this follows; nothing is decided here. A first version has no baseline to
judge a canary against: it is made the active version once its gate passed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.client import ClientError, RegistryClient

GATE_ENDS = ("passed", "failed", "expired", "none")
ROLLOUT_ENDS = ("completed", "rolled_back")


@dataclass(frozen=True)
class DeployPlan:
    adapter_dir: Path
    tenant: str
    adapter_id: str
    alias: str
    label: str
    owner: str = "cli"
    qos_tier: str = "silver"
    base_model: str | None = None
    regression_set: Path | None = None
    stages: list[int] | None = None
    min_stage_s: float | None = None
    timeout_s: float = 24 * 3600.0


@dataclass
class DeployOutcome:
    version: int
    status: str
    """completed | rolled_back | activated (a first version) | gate_failed | halted"""
    reason: str = ""
    rollout: dict[str, Any] | None = None
    gate: dict[str, Any] | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status in ("completed", "activated")


def arm(figures: dict[str, Any] | None) -> str:
    """One arm of a judgement, as the controller counted it."""
    if not figures:
        return "no figures"
    p95 = figures.get("p95_ms")
    return (f"{figures.get('errors', 0)}/{figures.get('requests', 0)} errors"
            + (f", p95 {p95:.0f} ms" if p95 is not None else ""))


def split_line(split: list[dict[str, Any]]) -> str:
    return ", ".join(f"v{e['version']} {e['weight']} %" for e in split)


class Deployment:
    """One deploy, reporting each thing that happens through `say` (one line each)."""

    def __init__(self, registry: RegistryClient, plan: DeployPlan,
                 say: Callable[[str], None], *, poll_s: float = 1.0,
                 progress: Callable[[str], None] | None = None) -> None:
        self.registry = registry
        self.plan = plan
        self.say = say
        self.progress = progress or (lambda _line: None)
        self.poll_s = poll_s
        self.deadline = time.monotonic() + plan.timeout_s

    def _wait(self) -> None:
        if time.monotonic() > self.deadline:
            raise ClientError(f"deploy did not finish in {self.plan.timeout_s:.0f} s; the "
                              f"rollout goes on (`loraplane aliases`)")
        time.sleep(self.poll_s)

    def run(self) -> DeployOutcome:
        p = self.plan
        before = self._active_version()
        answer = self.registry.publish(
            p.adapter_dir, tenant=p.tenant, adapter_id=p.adapter_id, label=p.label,
            owner=p.owner, base_model=p.base_model, qos_tier=p.qos_tier,
            regression_set=p.regression_set)
        version = int(answer["version"])
        self.say(f"published {p.adapter_id} v{version} ({answer['label']}) for {p.tenant}: "
                 f"rank {answer['rank']}, sha256 {answer['sha256'][:16]}…")
        gate = self._gate(version)
        if gate is not None and not gate.get("may_get_traffic"):
            failures = "; ".join(gate.get("failures") or []) or gate.get("error") or \
                gate.get("refusal") or gate.get("status")
            return DeployOutcome(version, "gate_failed", f"quality gate {gate.get('status')}: "
                                 f"{failures}", gate=gate)
        if before is None:
            self.registry.switch(p.adapter_id, version)
            self.say(f"v{version} is the first version of {p.adapter_id}: no baseline to "
                     "judge a canary against; made active")
            return DeployOutcome(version, "activated", gate=gate)
        return self._canary(version, gate)

    def _active_version(self) -> int | None:
        try:
            item = self.registry.request("GET", f"/v1/adapters/{self.plan.adapter_id}")
        except ClientError as exc:
            if " 404 " in f" {exc} ":
                return None
            raise
        active = item.get("active_version")
        return int(active) if active is not None else None

    def _gate(self, version: int) -> dict[str, Any] | None:
        path = f"/v1/adapters/{self.plan.adapter_id}/versions/{version}/gate"
        shown = None
        while True:
            gate = dict(self.registry.request("GET", path))
            status = gate.get("status")
            if not gate.get("gate_required") and status == "none":
                self.say("no quality gate required for this version (release_ungated=allow)")
                return gate
            if status != shown:
                shown = status
                where = f" on {gate['worker_id']}" if gate.get("worker_id") else ""
                self.say(f"quality gate: {status}{where}")
            if status in GATE_ENDS:
                return gate
            self.progress(f"quality gate {status}…")
            self._wait()

    def _canary(self, version: int, gate: dict[str, Any] | None) -> DeployOutcome:
        p = self.plan
        body: dict[str, Any] = {"adapter_id": p.adapter_id, "version": version,
                                "reason": f"loraplane deploy of {p.adapter_dir.name}"}
        if p.stages:
            body["stages"] = p.stages
        if p.min_stage_s:
            body["min_stage_s"] = p.min_stage_s
        started = dict(self.registry.request("POST", f"/v1/aliases/{p.alias}/rollout",
                                             json=body))
        plan = started["plan"]
        self.say(f"canary on alias {p.alias}: v{version} against v"
                 f"{started['baseline_version']}, stages "
                 f"{' → '.join(str(s) for s in plan['stages'])} %, at least "
                 f"{plan['min_stage_s']:g} s each; now {split_line(started['split'])}")
        seen: set[str] = set()
        steps: list[dict[str, Any]] = []
        while True:
            rollout = dict(self.registry.request("GET", f"/v1/aliases/{p.alias}/rollout"))
            for step in rollout.get("steps", []):
                key = f"{step.get('at')}|{step.get('action')}"
                if key in seen:
                    continue
                seen.add(key)
                steps.append(step)
                self.say(f"{str(step.get('at', ''))[11:19]}  {step.get('action', ''):<11} "
                         f"by {step.get('actor', '')}; now {split_line(rollout['split'])}")
            status = rollout["status"]
            if status in ROLLOUT_ENDS:
                return DeployOutcome(version, status, rollout.get("status_reason", ""),
                                     rollout=rollout, gate=gate, steps=steps)
            if status == "halted":
                return DeployOutcome(version, "halted", rollout.get("status_reason", ""),
                                     rollout=rollout, gate=gate, steps=steps)
            judged = rollout.get("last_judgement") or {}
            stage_at = rollout.get("stage_started_at") or rollout.get("started_at")
            self.progress(f"stage {rollout['stage'] + 1}/{len(plan['stages'])} at "
                          f"{rollout['weight']} % since {str(stage_at)[11:19]}; last "
                          f"judgement: {judged.get('verdict', 'none yet')}"
                          + (f" (canary {arm(judged.get('canary'))}, baseline "
                             f"{arm(judged.get('baseline'))})" if judged else ""))
            self._wait()
