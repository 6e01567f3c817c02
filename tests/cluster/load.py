"""Clients that load the cluster during a fault run and record every operation.

- writers, one per adapter: publish a version, switch to it, read the adapter back, over
  REST with the clients' own transport (`services.endpoints`: follows the active registry
  among the URLs), each write with an Idempotency-Key the checker finds in the log;
- generators: requests through the routers with the CLI's `InferenceClient` (gRPC, two
  router addresses, failover before the first token), each recording the version,
  worker and trace that served it;
- a prober: every registry's `/readyz`, four times a second.

Nothing is retried: an operation is recorded as it ended, and the checker decides what
the outcome allows (see `history.py`).
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from services.client import ClientError, InferenceClient
from services.config import Settings
from services.endpoints import registry_client
from tests.cluster.history import History, Op, Outcome
from tests.waiting import wait_for


@dataclass(frozen=True)
class Target:
    """Where the clients send their requests, and as whom."""

    registry_urls: list[str]
    router_addresses: list[str]
    admin_token: str
    inference_token: str
    base_model: str


@dataclass(frozen=True)
class AdapterPlan:
    adapter_id: str
    tenant: str
    """org/team/project"""


def classify(response: httpx.Response) -> Outcome:
    if response.is_success:
        return "ok"
    if response.status_code < 500:
        return "fail"
    try:
        body = response.json()
    except ValueError:
        return "unknown"
    return "fail" if isinstance(body, dict) and body.get("outcome") == "not_written" \
        else "unknown"


def _problem(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {"text": response.text[:200]}
    if not isinstance(body, dict):
        return {}
    return {"code": body.get("code"), "said": body.get("outcome"),
            "detail": str(body.get("detail"))[:300]}


class Load:
    def __init__(self, target: Target, history: History, adapters: list[AdapterPlan],
                 files: list[Path], *, seed: int, generators: int = 2,
                 write_pause_s: float = 0.4, generate_deadline_s: float = 20.0,
                 max_tokens: int = 4) -> None:
        self.target = target
        self.history = history
        self.adapters = adapters
        self.files = files
        self.random = random.Random(seed)
        self.generators = generators
        self.write_pause_s = write_pause_s
        self.generate_deadline_s = generate_deadline_s
        self.max_tokens = max_tokens
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.errors: list[str] = []

    # --- REST ----------------------------------------------------------------------------

    def http(self) -> httpx.Client:
        return registry_client(self.target.registry_urls, timeout=15.0, connect_timeout_s=2.0,
                               headers={"Authorization": f"Bearer {self.target.admin_token}"})

    def _record(self, op: Op, call: Any) -> httpx.Response | None:
        try:
            response = call()
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            History.complete(op, "fail", error=f"{type(exc).__name__}: {exc}")
            return None
        except httpx.HTTPError as exc:
            History.complete(op, "unknown", error=f"{type(exc).__name__}: {exc}")
            return None
        History.complete(op, classify(response), status=response.status_code,
                         registry=response.headers.get("x-loraplane-registry"),
                         read=response.headers.get("x-loraplane-read"),
                         **_problem(response) if not response.is_success else {})
        return response

    def publish(self, http: httpx.Client, client: str, plan: AdapterPlan,
                label: str) -> Op:
        key = f"{client}-{uuid.uuid4().hex[:12]}"
        op = self.history.invoke(client, "publish", adapter=plan.adapter_id, key=key,
                                 label=label)
        files = self.random.choice(self.files)
        org, team, project = plan.tenant.split("/")
        data = {"org": org, "team": team, "project": project, "owner": "chaos@example.com",
                "base_model": self.target.base_model, "label": label}
        with (files / "adapter_config.json").open("rb") as config, \
                (files / "adapter_model.safetensors").open("rb") as weights:
            response = self._record(op, lambda: http.post(
                f"/v1/adapters/{plan.adapter_id}/versions", data=data,
                headers={"Idempotency-Key": key},
                files={"adapter_config": ("adapter_config.json", config),
                       "adapter_model": ("adapter_model.safetensors", weights)}))
        if response is not None and response.is_success:
            op.result["version"] = response.json()["version"]
        return op

    def switch(self, http: httpx.Client, client: str, plan: AdapterPlan, version: int) -> Op:
        key = f"{client}-{uuid.uuid4().hex[:12]}"
        op = self.history.invoke(client, "switch", adapter=plan.adapter_id, key=key,
                                 version=version)
        self._record(op, lambda: http.put(f"/v1/adapters/{plan.adapter_id}/active",
                                          json={"version": version},
                                          headers={"Idempotency-Key": key}))
        return op

    def read(self, http: httpx.Client, client: str, plan: AdapterPlan) -> Op:
        op = self.history.invoke(client, "read", adapter=plan.adapter_id)
        response = self._record(op, lambda: http.get(f"/v1/adapters/{plan.adapter_id}"))
        if response is not None and response.is_success:
            body = response.json()
            op.result.update(latest=body["latest_version"], active=body["active_version"])
        return op

    def purge(self, tenant: str, deadline_s: float, retry_s: float = 60.0) -> Op:
        """Purge a tenant as the CLI does: a 503 or a lost answer is sent again under the
        same Idempotency-Key (each try is its own operation in the history)."""
        org, team, project = tenant.split("/")
        key = f"purge-{uuid.uuid4().hex[:12]}"
        give_up = time.monotonic() + retry_s
        with self.http() as http:
            while True:
                op = self.history.invoke("purger", "purge", tenant=tenant, key=key,
                                         deadline_s=deadline_s)
                response = self._record(op, lambda: http.post(
                    f"/v1/tenants/{org}/{team}/{project}/purge",
                    json={"deadline_s": deadline_s, "hard": True},
                    headers={"Idempotency-Key": key}))
                if response is not None and response.is_success:
                    op.result["purge_id"] = response.json()["purge_id"]
                    return op
                if op.outcome == "fail" and response is not None \
                        and response.status_code < 500:
                    return op
                if time.monotonic() > give_up:
                    return op
                time.sleep(1.0)

    # --- the loops -----------------------------------------------------------------------

    def start(self) -> None:
        for index, plan in enumerate(self.adapters):
            self._spawn(self._writer, f"writer-{index}", plan)
        for index in range(self.generators):
            self._spawn(self._generator, f"generator-{index}", index)
        self._spawn(self._prober, "prober")

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(self.generate_deadline_s + 20)
        self._threads.clear()

    def _spawn(self, target: Any, name: str, *args: Any) -> None:
        def run() -> None:
            try:
                target(name, *args)
            except Exception as exc:  # a crashed client is a finding, not a silent stop
                self.errors.append(f"{name}: {type(exc).__name__}: {exc}")
                raise

        thread = threading.Thread(target=run, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _writer(self, client: str, plan: AdapterPlan) -> None:
        with self.http() as http:
            step = 0
            while not self._stop.is_set():
                step += 1
                published = self.publish(http, client, plan, f"{client}-{step}")
                if published.outcome == "ok":
                    self.switch(http, client, plan, published.result["version"])
                self.read(http, client, plan)
                self._stop.wait(self.write_pause_s)

    def _generator(self, client: str, index: int) -> None:
        settings = Settings(router_addresses=",".join(self.target.router_addresses))
        chooser = random.Random(self.random.random() + index)
        with InferenceClient(settings, token=self.target.inference_token,
                             timeout_s=self.generate_deadline_s,
                             connect_timeout_s=2.0) as inference:
            while not self._stop.is_set():
                plan = chooser.choice(self.adapters)
                self.generate(inference, client, plan)

    def generate(self, inference: InferenceClient, client: str, plan: AdapterPlan) -> Op:
        op = self.history.invoke(client, "generate", adapter=plan.adapter_id,
                                 tenant=plan.tenant, deadline_s=self.generate_deadline_s)
        try:
            done = inference.complete(plan.tenant, adapter=plan.adapter_id,
                                      text="w1 w2 w3 w4", max_tokens=self.max_tokens,
                                      user=client)
        except ClientError as exc:
            code = str(exc).split(":", 1)[0]
            History.complete(op, "fail", code=code, error=str(exc)[:300],
                             router=inference.address)
            return op
        final = done.final
        History.complete(op, "ok", router=inference.address, worker=final.worker_id,
                         trace_id=final.trace_id, adapter=final.served_adapter.adapter_id,
                         version=final.served_adapter.version,
                         sha256=final.served_adapter.sha256)
        return op

    def _prober(self, client: str) -> None:
        with httpx.Client(timeout=1.0) as http:
            while not self._stop.is_set():
                for url in self.target.registry_urls:
                    op = self.history.invoke(client, "ready", url=url)
                    try:
                        response = http.get(f"{url}/readyz")
                        body = response.json()
                    except (httpx.HTTPError, ValueError) as exc:
                        History.complete(op, "fail", error=type(exc).__name__)
                        continue
                    History.complete(op, "ok", status=response.status_code,
                                     role=body.get("role"), reason=body.get("reason"),
                                     registry=body.get("registry_id"))
                self._stop.wait(0.25)


def wait_served(load: Load, plans: list[AdapterPlan], timeout_s: float = 90.0) -> None:
    """Every adapter served at least once (its first load done), before faults begin."""
    settings = Settings(router_addresses=",".join(load.target.router_addresses))
    started = time.monotonic()
    with InferenceClient(settings, token=load.target.inference_token,
                         timeout_s=load.generate_deadline_s) as inference:
        for plan in plans:
            results: list[dict[str, Any]] = []

            def served(plan: AdapterPlan = plan, results: list = results) -> bool:
                op = load.generate(inference, "setup", plan)
                results.append(op.result)
                return op.outcome == "ok"

            wait_for(served, max(0.0, timeout_s - (time.monotonic() - started)), interval_s=0.5,
                     message=lambda plan=plan, results=results:
                     f"{plan.adapter_id} served; last answer {results[-1:]}")
