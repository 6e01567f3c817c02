"""Clients of a running loraplane: the registry over REST, inference through the router
over gRPC, and where to find them.

The CLI and the demo use these; they never build requests themselves. Every failure is a
`ClientError` whose message is one line a person can act on: the registry's problem+json
`detail`, the gRPC status and its details, or, when nothing listens, where it looked and
what to start.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import grpc
import httpx
from tenacity import Retrying, retry_if_exception_type, stop_after_delay

from services import tls
from services.config import Settings
from services.contracts.grpc import inference_pb2 as pb
from services.contracts.grpc import inference_pb2_grpc as pb_grpc
from services.endpoints import not_written, registry_client

ENDPOINTS_FILE = "endpoints.json"


class ClientError(RuntimeError):
    """A request that failed, in one line."""


# --- finding the stack ---------------------------------------------------------------------


def stack_document(state_dir: Path) -> dict[str, Any] | None:
    """What a running `loraplane up` wrote about itself in `state_dir`, if it runs."""
    path = state_dir / ENDPOINTS_FILE
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def adopt_stack_env(environ: dict[str, str] | None = None) -> dict[str, Any] | None:
    """Take the running stack's LORAPLANE_* variables where the environment names none.

    The environment wins, so the same CLI works against docker compose (or any deployment)
    by environment alone, and against a local `up` with nothing set.
    """
    environ = os.environ if environ is None else environ
    document = stack_document(Settings().state_dir)
    if document is None:
        return None
    for key, value in document.get("env", {}).items():
        environ.setdefault(key, value)
    return document


def api_token(settings: Settings) -> str | None:
    """LORAPLANE_API_TOKEN, else the admin token a local `loraplane up` wrote."""
    if settings.api_token:
        return settings.api_token
    written = settings.state_dir / "admin.token"
    return written.read_text().strip() if written.exists() else None


def tenant_parts(tenant: str) -> tuple[str, str, str]:
    parts = tenant.split("/")
    if len(parts) != 3 or not all(parts):
        raise ClientError(f"tenant {tenant!r} is not org/team/project")
    return parts[0], parts[1], parts[2]


# --- registry ------------------------------------------------------------------------------


def problem_line(response: httpx.Response) -> str:
    """One line for a failed registry answer: problem+json `detail` (and the field)."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("detail"):
        where = f" ({body['field']})" if body.get("field") else ""
        return f"{response.status_code} {body.get('title') or ''}: {body['detail']}{where}" \
            .replace(" :", ":")
    if isinstance(body, dict) and isinstance(body.get("detail"), list):  # FastAPI 422
        return f"{response.status_code}: {body['detail']}"
    text = response.text.strip().splitlines()[0] if response.text.strip() else ""
    return f"{response.status_code} {response.reason_phrase}: {text}".rstrip(": ")


class _Progress:
    """A file whose reads advance a progress callback (httpx streams multipart parts by
    reading them). No `fileno`: httpx then sizes it by seek/tell, not by fstat."""

    def __init__(self, handle: IO[bytes], advance: Callable[[int], None]) -> None:
        self._handle = handle
        self._advance = advance

    def read(self, n: int = -1) -> bytes:
        chunk = self._handle.read(n)
        self._advance(len(chunk))
        return chunk

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._handle.seek(offset, whence)

    def tell(self) -> int:
        return self._handle.tell()

    def close(self) -> None:
        self._handle.close()

    def rewind(self) -> None:
        """Back to the start for another try of the upload; the progress goes back too."""
        self._advance(-self._handle.tell())
        self._handle.seek(0)

    def __iter__(self) -> Iterator[bytes]:
        while chunk := self.read(1 << 16):
            yield chunk


class _Unavailable(Exception):
    """A 503 to a request that is safe to send again (it carries an Idempotency-Key)."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(response.status_code)
        self.response = response
        try:
            self.retry_after_s = max(0.0, float(response.headers.get("Retry-After", 1)))
        except ValueError:  # an HTTP date: not what the registry sends
            self.retry_after_s = 1.0


def _rewind(files: Any) -> None:
    """Every upload of a multipart request back to its start, for another try."""
    for part in (files or {}).values():
        stream = part[1] if isinstance(part, tuple) else part
        if isinstance(stream, _Progress):
            stream.rewind()
        elif hasattr(stream, "seek"):
            stream.seek(0)


@dataclass
class RegistryClient:
    """The registry's REST API, over every URL of `LORAPLANE_REGISTRY_URL`
    (`services.endpoints`: requests follow the active registry among its standbys).

    A command that gets 503 is sent again after the answer's Retry-After, for up to
    `retry_s`, when that cannot do it twice: it carries an Idempotency-Key (publish,
    purge: the registry answers a repeat with the first answer), or the registry said
    it was `not_written` (a standby during a takeover, a registry replaying). Other 503s
    (the outcome is unknown) are answered at once, for the caller to decide."""

    settings: Settings
    token: str | None = None
    timeout_s: float = 60.0
    retry_s: float = 30.0

    def __post_init__(self) -> None:
        self.urls = self.settings.registry_urls
        token = self.token or api_token(self.settings)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = registry_client(self.urls, headers=headers, timeout=self.timeout_s,
                                     verify=tls.client_ssl_context(self.settings))

    @property
    def url(self) -> str:
        """The registry that answered last."""
        transport = self._http._transport
        return str(getattr(transport, "current", self.urls[0]))

    @property
    def where(self) -> str:
        return self.urls[0] if len(self.urls) == 1 else ", ".join(self.urls)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, *, ok: tuple[int, ...] = (200, 201, 202),
                **kw: Any) -> Any:
        keyed = "Idempotency-Key" in (kw.get("headers") or {})
        retrying = Retrying(
            stop=stop_after_delay(self.retry_s), reraise=True,
            retry=retry_if_exception_type(_Unavailable),
            wait=lambda state: min(10.0, state.outcome.exception().retry_after_s),  # type: ignore[union-attr]
            before=lambda state: _rewind(kw.get("files")) if state.attempt_number > 1
            else None)
        try:
            for attempt in retrying:
                with attempt:
                    response = self._send(method, path, **kw)
                    if response.status_code == 503 and (keyed or not_written(response)):
                        raise _Unavailable(response)
        except _Unavailable as exc:
            response = exc.response
        return self._answer(method, path, ok, response)

    def _send(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            return self._http.request(method, path, **kw)
        except httpx.ConnectError:
            raise ClientError(f"no registry at {self.where}: is `loraplane up` running? "
                              "(or set LORAPLANE_REGISTRY_URL)") from None
        except httpx.TimeoutException:
            raise ClientError(f"the registry at {self.where} did not answer in "
                              f"{self.timeout_s:.0f}s") from None
        except httpx.HTTPError as exc:
            raise ClientError(f"registry at {self.where}: {exc}") from None

    @staticmethod
    def _answer(method: str, path: str, ok: tuple[int, ...], response: httpx.Response) -> Any:
        if response.status_code not in ok:
            raise ClientError(f"{method} {path}: {problem_line(response)}")
        return response.json() if response.content else None

    # --- reads ---

    def ready(self) -> dict[str, Any]:
        try:
            response = self._http.get("/readyz", timeout=3)
        except httpx.HTTPError:
            raise ClientError(f"no registry at {self.where}: is `loraplane up` running?") \
                from None
        return dict(response.json())

    def base_models(self) -> list[dict[str, Any]]:
        return list(self.request("GET", "/v1/base-models"))

    def adapters(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        cursor: str | None = None
        while True:
            page = self.request("GET", "/v1/adapters",
                                params={"limit": 200, **({"cursor": cursor} if cursor else {})})
            items += page.get("items", [])
            cursor = page.get("next_cursor")
            if not cursor:
                return items

    def alias(self, alias: str) -> dict[str, Any]:
        return dict(self.request("GET", f"/v1/aliases/{alias}"))

    def purge(self, purge_id: str) -> dict[str, Any]:
        return dict(self.request("GET", f"/v1/purges/{purge_id}"))

    # --- commands ---

    def default_base_model(self) -> str:
        models = self.base_models()
        if len(models) == 1:
            return str(models[0]["name"])
        names = ", ".join(m["name"] for m in models) or "none"
        raise ClientError(f"name the base model with --base-model (registered: {names})")

    def publish(self, adapter_dir: Path, *, tenant: str, adapter_id: str, label: str,
                owner: str, base_model: str | None = None, qos_tier: str = "silver",
                regression_set: Path | None = None,
                progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        """Upload a PEFT directory (adapter_config.json + adapter_model.safetensors);
        `progress(sent, total)` follows the upload."""
        config = adapter_dir / "adapter_config.json"
        weights = adapter_dir / "adapter_model.safetensors"
        for path in (config, weights):
            if not path.is_file():
                raise ClientError(f"{adapter_dir} has no {path.name} (a PEFT adapter folder "
                                  "holds adapter_config.json and adapter_model.safetensors)")
        org, team, project = tenant_parts(tenant)
        paths = {"adapter_config": config, "adapter_model": weights}
        if regression_set is not None:
            if not regression_set.is_file():
                raise ClientError(f"no regression set at {regression_set}")
            paths["regression_set"] = regression_set
        total = sum(p.stat().st_size for p in paths.values())
        sent = 0

        def advance(n: int) -> None:
            nonlocal sent
            sent += n
            if progress is not None:
                progress(min(sent, total), total)

        handles = {name: path.open("rb") for name, path in paths.items()}
        try:
            files = {name: (paths[name].name, _Progress(h, advance))
                     for name, h in handles.items()}
            data = {"org": org, "team": team, "project": project, "owner": owner,
                    "base_model": base_model or self.default_base_model(), "label": label,
                    "qos_tier": qos_tier}
            return dict(self.request("POST", f"/v1/adapters/{adapter_id}/versions",
                                     data=data, files=files,
                                     headers={"Idempotency-Key": uuid.uuid4().hex}))
        finally:
            for handle in handles.values():
                handle.close()

    def register_base_model(self, model_dir: Path, name: str | None = None
                            ) -> tuple[str, str, bool]:
        """Register a Hugging Face model directory under the digest workers compute for it
        (idempotent: a digest already registered keeps its name). Returns (name, digest,
        whether it was new). The name defaults to the folder's, made a registry id."""
        import re

        from services.worker.engine import CheckpointError, checkpoint_digest

        try:
            digest = checkpoint_digest(model_dir)
            config = json.loads((model_dir / "config.json").read_text())
        except (CheckpointError, OSError, ValueError) as exc:
            raise ClientError(f"{model_dir}: {exc}") from None
        known = self.base_models()
        for model in known:
            if model["digest"] == digest:
                return str(model["name"]), digest, False
        if name is None:
            name = re.sub(r"[^a-z0-9._-]+", "-", model_dir.resolve().name.lower()).strip("-._")
            name = (name or "base-model")[:100]
            if name in {m["name"] for m in known}:  # another model under this folder name
                name = f"{name[:87]}-{digest[:12]}"
        self.request("POST", "/v1/base-models", ok=(201,),
                     json={"name": name, "digest": digest, "config": config},
                     headers={"Idempotency-Key": uuid.uuid4().hex})
        return name, digest, True

    def split(self, alias: str, weights: list[tuple[str, int, int]]) -> dict[str, Any]:
        body = {"split": [{"adapter_id": a, "version": v, "weight": w} for a, v, w in weights]}
        return dict(self.request("PUT", f"/v1/aliases/{alias}", json=body))

    def switch(self, adapter_id: str, version: int) -> dict[str, Any]:
        return dict(self.request("PUT", f"/v1/adapters/{adapter_id}/active",
                                 json={"version": version}))

    def rollback(self, adapter_id: str, reason: str, to_version: int | None = None
                 ) -> dict[str, Any]:
        return dict(self.request("POST", f"/v1/adapters/{adapter_id}/rollback",
                                 json={"reason": reason, "to_version": to_version}))

    def disable(self, adapter_id: str, version: int, reason: str) -> dict[str, Any]:
        return dict(self.request("POST", f"/v1/adapters/{adapter_id}/versions/{version}/"
                                 "disable", json={"reason": reason}))

    def enable(self, adapter_id: str, version: int, reason: str) -> dict[str, Any]:
        return dict(self.request("POST", f"/v1/adapters/{adapter_id}/versions/{version}/"
                                 "enable", json={"reason": reason}))

    def override_gate(self, adapter_id: str, version: int, reason: str) -> dict[str, Any]:
        return dict(self.request("POST", f"/v1/adapters/{adapter_id}/versions/{version}/"
                                 "override", json={"reason": reason}))

    def purge_tenant(self, tenant: str, deadline_s: float = 60.0) -> dict[str, Any]:
        org, team, project = tenant_parts(tenant)
        return dict(self.request("POST", f"/v1/tenants/{org}/{team}/{project}/purge",
                                 json={"deadline_s": deadline_s, "hard": True},
                                 headers={"Idempotency-Key": uuid.uuid4().hex}))


# --- inference -----------------------------------------------------------------------------


@dataclass
class Completion:
    text: str
    final: pb.FinalUsage


def status_line(error: grpc.RpcError, address: str) -> str:
    """One line for a failed call: the status code and its details."""
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else str(error)
    if code == grpc.StatusCode.UNAVAILABLE and "connect" in (details or "").lower():
        return f"no router at {address}: is `loraplane up` running? (or set " \
               "LORAPLANE_ROUTER_HOST / LORAPLANE_ROUTER_PORT)"
    name = code.name if code is not None else "ERROR"
    return f"{name}: {details}"


def adapter_ref(adapter: str | None) -> pb.AdapterRef | None:
    """`alias-or-adapter`, or `adapter@version` for a pinned version; None = base model."""
    if not adapter:
        return None
    if "@" in adapter:
        name, _, version = adapter.partition("@")
        if not version.isdigit():
            raise ClientError(f"{adapter!r}: a pinned version is ADAPTER@N")
        return pb.AdapterRef(pinned=pb.PinnedVersion(adapter_id=name, version=int(version)))
    return pb.AdapterRef(alias=adapter)


FAILOVER_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})
"""A router that answers this before the first token may be gone: try the next one."""


@dataclass
class InferenceClient:
    """Inference through the routers of `LORAPLANE_ROUTER_ADDRESSES` (default the one at
    ROUTER_HOST:ROUTER_PORT). Any router serves any request, so a request whose router
    cannot be reached (no connection within `connect_timeout_s`, or UNAVAILABLE before
    the first token) goes to the next one; after a token, the
    error is the caller's, as the request may have been served. Requests go to the
    router that answered last."""

    settings: Settings
    token: str | None = None
    timeout_s: float = 300.0
    connect_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        self.addresses = self.settings.router_targets
        self._current = 0
        self._channels = [tls.channel(a, self.settings) for a in self.addresses]
        self._stubs = [pb_grpc.InferenceStub(c) for c in self._channels]
        self._states: list[grpc.ChannelConnectivity | None] = [None] * len(self._channels)
        self._usable = [threading.Event() for _ in self._channels]
        self._watchers: list[tuple[grpc.Channel, Callable[[Any], None]]] = []
        if len(self._channels) > 1:  # one router needs no choosing
            for index, channel in enumerate(self._channels):
                def watch(state: grpc.ChannelConnectivity, index: int = index) -> None:
                    self._states[index] = state
                    if state in (grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.IDLE):
                        self._usable[index].set()
                    else:
                        self._usable[index].clear()

                channel.subscribe(watch, try_to_connect=True)
                self._watchers.append((channel, watch))
        token = self.token or api_token(self.settings)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()

    @property
    def address(self) -> str:
        """The router that answered last."""
        return self.addresses[self._current]

    def close(self) -> None:
        for channel, watch in self._watchers:
            channel.unsubscribe(watch)
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> InferenceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stream(self, tenant: str, *, adapter: str | None = None, text: str | None = None,
               chat: list[tuple[str, str]] | None = None, user: str = "cli",
               max_tokens: int = 128, temperature: float = 0.0,
               seed: int | None = None) -> Iterator[pb.TokenChunk | pb.FinalUsage]:
        """Tokens as they come, then the FinalUsage."""
        org, team, project = tenant_parts(tenant)
        request = pb.GenerateRequest(
            tenant=pb.TenantSignature(org_id=org, team_id=team, project_id=project,
                                      user_id=user),
            adapter=adapter_ref(adapter),
            sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                       **({"seed": seed} if seed is not None else {})))
        if chat is not None:
            request.chat.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in chat)
        else:
            request.text = text or ""
        deadline = time.monotonic() + self.timeout_s
        count = len(self.addresses)
        for step in range(count):
            index = (self._current + step) % count
            last = step == count - 1
            if not last and not self._reachable(index):
                continue
            answered = False
            try:
                calls = self._stubs[index].Generate(
                    request, timeout=max(0.01, deadline - time.monotonic()),
                    metadata=self._metadata)
                for answer in calls:
                    if not answered:
                        answered = True
                        self._current = index
                    if answer.HasField("token"):
                        yield answer.token
                    elif answer.HasField("final"):
                        yield answer.final
                return
            except grpc.RpcError as exc:
                if answered or last or exc.code() not in FAILOVER_CODES:
                    raise ClientError(status_line(exc, self.addresses[index])) from None

    def _reachable(self, index: int) -> bool:
        """The router's connection is up (or idle: the call connects), or comes up within
        `connect_timeout_s`; a router that refused the last connection is skipped."""
        if self._states[index] in (grpc.ChannelConnectivity.TRANSIENT_FAILURE,
                                   grpc.ChannelConnectivity.SHUTDOWN):
            return False
        return self._usable[index].wait(self.connect_timeout_s)

    def complete(self, tenant: str, **kw: Any) -> Completion:
        parts: list[str] = []
        final = None
        for item in self.stream(tenant, **kw):
            if isinstance(item, pb.TokenChunk):
                parts.append(item.text)
            else:
                final = item
        if final is None:
            raise ClientError("the stream ended without its final usage")
        return Completion("".join(parts), final)


def grpc_serving(address: str, settings: Settings | None = None) -> bool:
    """Whether the gRPC health service at `address` says SERVING (a worker's readiness);
    over TLS when `settings` dial TLS."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with (tls.channel(address, settings) if settings is not None
          else grpc.insecure_channel(address)) as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=1.0)
        except grpc.RpcError:
            return False
        return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)


# --- status --------------------------------------------------------------------------------


def lease_age_s(settings: Settings, now: float | None = None) -> float | None:
    """Seconds since the newest registry lease on the liveness topic (None: none seen).

    Reads only the last few records of each partition: the lease stream is one key."""
    from confluent_kafka import Consumer, TopicPartition

    from services.contracts.codec import decode
    from services.contracts.events import RegistryLease
    from services.eventlog.client import consumer_config

    consumer = Consumer({**consumer_config(settings, f"loraplane-cli-{uuid.uuid4().hex[:8]}"),
                         "enable.partition.eof": True})
    try:
        metadata = consumer.list_topics(settings.liveness_topic, timeout=5)
        topic = metadata.topics.get(settings.liveness_topic)
        if topic is None or topic.error is not None:
            return None
        assignment = []
        for p in topic.partitions:
            low, high = consumer.get_watermark_offsets(
                TopicPartition(settings.liveness_topic, p), timeout=5)
            if high > low:
                assignment.append(TopicPartition(settings.liveness_topic, p,
                                                 max(low, high - 64)))
        if not assignment:
            return None
        consumer.assign(assignment)
        newest = None
        open_partitions = len(assignment)
        deadline = time.monotonic() + 5
        while open_partitions and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is None:
                continue
            if message.error() is not None:
                open_partitions -= 1  # end of partition (or an error: stop reading it)
                continue
            try:
                envelope = decode(message.value())
            except Exception:
                continue
            if isinstance(envelope.payload, RegistryLease) and \
                    (newest is None or envelope.occurred_at > newest):
                newest = envelope.occurred_at
        if newest is None:
            return None
        return (time.time() if now is None else now) - newest.timestamp()
    finally:
        consumer.close()


def scrape(url: str, verify: Any = True) -> dict[str, float]:
    """A /metrics page as {name{labels}: value}; empty when it does not answer."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(url, timeout=2, verify=verify).text
    except httpx.HTTPError:
        return {}
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values
