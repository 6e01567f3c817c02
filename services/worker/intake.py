"""A `GenerateRequest` checked and turned into the work the engine loop takes.

Pure: no gRPC context, no engine. Every refusal is an `InvalidArgument` naming the field
the caller must fix (`prompt`, `sampling.top_p`, `tenant.org_id`, `chat`, …), which the
server answers as INVALID_ARGUMENT.
"""

from __future__ import annotations

import math
import re
import uuid
from dataclasses import dataclass
from typing import Any

from services.contracts.events import ID_PATTERN, SLUG_PATTERN, TenantRef
from services.contracts.grpc import inference_pb2 as pb
from services.worker.chat import ChatTemplate, ChatTemplateError
from services.worker.engine import SamplingParams

_SLUG = re.compile(SLUG_PATTERN)
_ID = re.compile(ID_PATTERN)
_TRACE = re.compile(r"^[0-9a-f]{32}$")
_REQUEST_ID = re.compile(r"^[\x21-\x7e]{1,128}$")

QOS_NAMES = {pb.QOS_TIER_BRONZE: "bronze", pb.QOS_TIER_SILVER: "silver",
             pb.QOS_TIER_GOLD: "gold", pb.QOS_TIER_PLATINUM: "platinum"}
MAX_STOP_STRINGS = 16
MAX_CHAT_MESSAGES = 1024


class InvalidArgument(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class AdapterAsk:
    """What the request names: an alias or adapter id (`reference`), or `adapter_id@version`."""

    reference: str | None = None
    pinned: tuple[str, int] | None = None

    @property
    def text(self) -> str:
        return self.reference or f"{self.pinned[0]}@{self.pinned[1]}"  # type: ignore[index]


@dataclass(frozen=True)
class WorkItem:
    request_id: str
    trace_id: str
    tenant: TenantRef
    user_id: str
    sharing_scope: str
    qos_tier: str
    """The signature's tier: used for base-model requests (an adapter's own tier wins)."""
    adapter: AdapterAsk | None
    prompt_ids: list[int]
    sampling: SamplingParams


@dataclass(frozen=True)
class PromptRules:
    """What the loaded base model accepts."""

    vocab_size: int
    max_model_len: int
    default_max_tokens: int
    tokenizer: Any | None = None
    chat_template: ChatTemplate | None = None


def _slug(value: str, field: str) -> str:
    if not value:
        raise InvalidArgument(field, "is required")
    if not _SLUG.match(value):
        raise InvalidArgument(field, f"{value!r} must match {SLUG_PATTERN}")
    return value


def _tenant(sig: pb.TenantSignature) -> TenantRef:
    return TenantRef(org=_slug(sig.org_id, "tenant.org_id"),
                     team=_slug(sig.team_id, "tenant.team_id"),
                     project=_slug(sig.project_id, "tenant.project_id"))


def _adapter(request: pb.GenerateRequest) -> AdapterAsk | None:
    if not request.HasField("adapter"):
        return None
    which = request.adapter.WhichOneof("ref")
    if which is None:
        return None
    if which == "alias":
        name = request.adapter.alias
        if not _ID.match(name):
            raise InvalidArgument("adapter.alias", f"{name!r} must match {ID_PATTERN}")
        return AdapterAsk(reference=name)
    pinned = request.adapter.pinned
    if not _ID.match(pinned.adapter_id):
        raise InvalidArgument("adapter.pinned.adapter_id",
                              f"{pinned.adapter_id!r} must match {ID_PATTERN}")
    if pinned.version < 1:
        raise InvalidArgument("adapter.pinned.version", "must be >= 1")
    return AdapterAsk(pinned=(pinned.adapter_id, int(pinned.version)))


def _prompt(request: pb.GenerateRequest, rules: PromptRules) -> list[int]:
    which = request.WhichOneof("prompt")
    if which is None:
        raise InvalidArgument("prompt", "give text, token_ids or chat")
    if which == "token_ids":
        ids = list(request.token_ids.ids)
        if not ids:
            raise InvalidArgument("prompt.token_ids", "is empty")
        bad = next((t for t in ids if t >= rules.vocab_size), None)
        if bad is not None:
            raise InvalidArgument("prompt.token_ids", f"token {bad} is outside the vocabulary "
                                                      f"of {rules.vocab_size}")
        return ids
    if rules.tokenizer is None:
        raise InvalidArgument(f"prompt.{which}", "the base model has no tokenizer.json; "
                                                 "send token_ids")
    if which == "text":
        if not request.text:
            raise InvalidArgument("prompt.text", "is empty")
        ids = list(rules.tokenizer.encode(request.text).ids)
    else:
        ids = _chat(request.chat, rules)
    if not ids:
        raise InvalidArgument(f"prompt.{which}", "tokenises to no tokens")
    return ids


def _chat(chat: pb.ChatMessages, rules: PromptRules) -> list[int]:
    if rules.chat_template is None:
        raise InvalidArgument("chat", "the base model has no chat template (tokenizer_config."
                                      "json chat_template); send text or token_ids")
    if not chat.messages:
        raise InvalidArgument("chat.messages", "is empty")
    if len(chat.messages) > MAX_CHAT_MESSAGES:
        raise InvalidArgument("chat.messages", f"more than {MAX_CHAT_MESSAGES} messages")
    for i, m in enumerate(chat.messages):
        if not m.role:
            raise InvalidArgument(f"chat.messages[{i}].role", "is required")
    try:
        text = rules.chat_template.render([{"role": m.role, "content": m.content}
                                           for m in chat.messages])
    except ChatTemplateError as exc:
        raise InvalidArgument("chat", str(exc)) from None
    return list(rules.tokenizer.encode(text, add_special_tokens=False).ids)


def _sampling(s: pb.SamplingParams, prompt_len: int, rules: PromptRules) -> SamplingParams:
    room = rules.max_model_len - prompt_len
    if room < 1:
        raise InvalidArgument("prompt", f"{prompt_len} tokens leave no room for a completion "
                                        f"in the model's context of {rules.max_model_len}")
    max_tokens = s.max_tokens or min(rules.default_max_tokens, room)
    if max_tokens > room:
        raise InvalidArgument("sampling.max_tokens",
                              f"{max_tokens} + {prompt_len} prompt tokens exceed the model's "
                              f"context of {rules.max_model_len}")
    if s.min_tokens > max_tokens:
        raise InvalidArgument("sampling.min_tokens", f"{s.min_tokens} exceeds max_tokens "
                                                     f"{max_tokens}")
    if not math.isfinite(s.temperature) or s.temperature < 0:
        raise InvalidArgument("sampling.temperature", f"{s.temperature} must be >= 0")
    if not math.isfinite(s.top_p) or not 0 <= s.top_p <= 1:
        raise InvalidArgument("sampling.top_p", f"{s.top_p} must be in [0, 1] (0 or 1 = off)")
    stops = tuple(s.stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidArgument("sampling.stop", f"at most {MAX_STOP_STRINGS} stop strings")
    if any(not x for x in stops):
        raise InvalidArgument("sampling.stop", "stop strings must be non-empty")
    if stops and rules.tokenizer is None:
        raise InvalidArgument("sampling.stop", "stop strings need the model's tokenizer")
    return SamplingParams(max_tokens=max_tokens, min_tokens=s.min_tokens,
                          temperature=float(s.temperature), top_p=float(s.top_p or 1.0),
                          seed=s.seed if s.HasField("seed") else None, stop=stops,
                          ignore_eos=s.ignore_eos)


def work_item(request: pb.GenerateRequest, rules: PromptRules) -> WorkItem:
    """Check a request; raises InvalidArgument naming the first bad field."""
    if not request.HasField("tenant"):
        raise InvalidArgument("tenant", "is required")
    tenant = _tenant(request.tenant)
    request_id = request.request_id or uuid.uuid4().hex
    if not _REQUEST_ID.match(request_id):
        raise InvalidArgument("request_id", "1-128 printable ASCII characters")
    trace_id = request.trace_id or uuid.uuid4().hex
    if not _TRACE.match(trace_id):
        raise InvalidArgument("trace_id", "32 lowercase hex characters")
    adapter = _adapter(request)
    ids = _prompt(request, rules)
    if len(ids) >= rules.max_model_len:
        raise InvalidArgument("prompt", f"{len(ids)} tokens; the model's context is "
                                        f"{rules.max_model_len}")
    sampling = _sampling(request.sampling, len(ids), rules)
    sig = request.tenant
    return WorkItem(request_id=request_id, trace_id=trace_id, tenant=tenant,
                    user_id=sig.user_id, sharing_scope=sig.compliance_scope or "default",
                    qos_tier=QOS_NAMES.get(sig.qos_tier, "silver"), adapter=adapter,
                    prompt_ids=ids, sampling=sampling)
