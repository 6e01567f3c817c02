"""A `GenerateRequest` checked and turned into the work the engine loop takes.

Pure: no gRPC context, no engine. The rules the router checks too are
`services.contracts.generate`'s (run again here, with this worker's own limits, for
clients that call a worker directly); what needs the tokenizer is here. Every refusal is
an `InvalidArgument` naming the field the caller must fix (`prompt`, `sampling.top_p`,
`tenant.org_id`, `chat`, …), which the server answers as INVALID_ARGUMENT.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from services.contracts.events import ID_PATTERN, SLUG_PATTERN, TenantRef
from services.contracts.generate import (
    InvalidArgument,
    ModelLimits,
    Undecodable,
    check_generate,
    check_limits,
)
from services.contracts.grpc import inference_pb2 as pb
from services.worker.chat import ChatTemplate, ChatTemplateError
from services.worker.engine import RequestError, SamplingParams
from services.worker.engine.grammar import tool_call_guide
from services.worker.engine.request import GuideSpec

_SLUG = re.compile(SLUG_PATTERN)
_ID = re.compile(ID_PATTERN)

QOS_NAMES = {pb.QOS_TIER_BRONZE: "bronze", pb.QOS_TIER_SILVER: "silver",
             pb.QOS_TIER_GOLD: "gold", pb.QOS_TIER_PLATINUM: "platinum"}


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
    returned: int = 1
    """Choices answered (n); `sampling.n` sequences are generated (best_of)."""
    echo: bool = False
    tool_format: str | None = None
    """Set when the chat offers tools: the format tool calls are parsed from."""


@dataclass(frozen=True)
class PromptRules:
    """What the loaded base model accepts."""

    vocab_size: int
    max_model_len: int
    default_max_tokens: int
    tokenizer: Any | None = None
    chat_template: ChatTemplate | None = None
    grammars: Any | None = None
    """The engine's `GrammarCache`: a guide that does not compile is refused here."""

    @property
    def limits(self) -> ModelLimits:
        return ModelLimits(self.vocab_size, self.max_model_len)


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
    """The prompt's token ids (`check_generate` has seen that there is one)."""
    which = request.WhichOneof("prompt")
    if which == "token_ids":
        return list(request.token_ids.ids)
    if rules.tokenizer is None:
        raise InvalidArgument(f"prompt.{which}", "the base model has no tokenizer.json; "
                                                 "send token_ids")
    if which == "text":
        ids = list(rules.tokenizer.encode(request.text).ids)
    else:
        ids = render_chat(request.chat, rules)
    if not ids:
        raise InvalidArgument(f"prompt.{which}", "tokenises to no tokens")
    return ids


def tools_of(chat: pb.ChatMessages) -> list[dict[str, Any]]:
    """The chat's tools in OpenAI's shape (what templates and xgrammar read)."""
    return [{"type": "function", "function": {
        "name": t.name, "description": t.description,
        "parameters": json.loads(t.parameters) if t.parameters else {"type": "object"}}}
        for t in chat.tools]


def _message(m: pb.ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.name, "arguments": json.loads(c.arguments or "{}")}}
            for c in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def render_chat(chat: pb.ChatMessages, rules: PromptRules) -> list[int]:
    """A chat's prompt tokens through the model's chat template (tools included)."""
    if rules.chat_template is None:
        raise InvalidArgument("chat", "the base model has no chat template (tokenizer_config."
                                      "json chat_template); send text or token_ids")
    try:
        text = rules.chat_template.render([_message(m) for m in chat.messages],
                                          tools_of(chat) or None)
    except ChatTemplateError as exc:
        raise InvalidArgument("chat", str(exc)) from None
    return list(rules.tokenizer.encode(text, add_special_tokens=False).ids)




def _bad_words(words: Any, rules: PromptRules) -> tuple[tuple[int, ...], ...]:
    """Each word's token ids as it would appear alone and after a space (vLLM's rule)."""
    if not words:
        return ()
    if rules.tokenizer is None:
        raise InvalidArgument("sampling.bad_words", "bad words need the model's tokenizer")
    found: list[tuple[int, ...]] = []
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = tuple(rules.tokenizer.encode(text, add_special_tokens=False).ids)
            if ids and ids not in found:
                found.append(ids)
    return tuple(found)


def _guide(request: pb.GenerateRequest, rules: PromptRules) -> GuideSpec | None:
    s = request.sampling
    choice = s.tool_choice
    if choice not in ("", "auto", "none") and rules.chat_template is not None:
        return tool_call_guide(rules.chat_template.tool_format, tools_of(request.chat),
                               choice, s.parallel_tool_calls)
    if not s.HasField("guide"):
        return None
    which = s.guide.WhichOneof("kind")
    if which == "choice":
        return GuideSpec("choice", json.dumps(list(s.guide.choice.choices)))
    if which == "json_object":
        return GuideSpec("json_object")
    return GuideSpec(str(which), getattr(s.guide, str(which)))


def _sampling(s: pb.SamplingParams, prompt_len: int, rules: PromptRules,
              guide: GuideSpec | None = None) -> SamplingParams:
    """Engine settings; the ranges were checked by `check_generate` / `check_limits`."""
    max_tokens = s.max_tokens or min(rules.default_max_tokens,
                                     rules.max_model_len - prompt_len)
    if s.min_tokens > max_tokens:
        raise InvalidArgument("sampling.min_tokens", f"{s.min_tokens} exceeds max_tokens "
                                                     f"{max_tokens}")
    if s.stop and rules.tokenizer is None:
        raise InvalidArgument("sampling.stop", "stop strings need the model's tokenizer")
    return SamplingParams(
        max_tokens=max_tokens, min_tokens=s.min_tokens, temperature=float(s.temperature),
        top_p=float(s.top_p or 1.0), seed=s.seed if s.HasField("seed") else None,
        stop=tuple(s.stop), ignore_eos=s.ignore_eos, top_k=max(0, s.top_k),
        min_p=float(s.min_p), repetition_penalty=float(s.repetition_penalty or 1.0),
        presence_penalty=float(s.presence_penalty),
        frequency_penalty=float(s.frequency_penalty),
        logit_bias=tuple(sorted((int(t), float(b)) for t, b in s.logit_bias.items())),
        stop_token_ids=tuple(s.stop_token_ids), bad_words_ids=_bad_words(s.bad_words, rules),
        logprobs=s.logprobs, top_logprobs=s.top_logprobs,
        prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
        n=max(s.n, s.best_of, 1), guide=guide)


def work_item(request: pb.GenerateRequest | Undecodable, rules: PromptRules) -> WorkItem:
    """Check a request; raises InvalidArgument naming the first bad field."""
    check_generate(request)
    assert isinstance(request, pb.GenerateRequest)
    if not request.HasField("tenant"):
        raise InvalidArgument("tenant", "is required")
    tenant = _tenant(request.tenant)
    request_id = request.request_id or uuid.uuid4().hex
    trace_id = request.trace_id or uuid.uuid4().hex
    adapter = _adapter(request)
    ids = _prompt(request, rules)
    check_limits(request, rules.limits, len(ids))
    guide = _guide(request, rules)
    if guide is not None and rules.grammars is not None:
        try:
            rules.grammars.compile(guide)
        except RequestError as exc:
            raise InvalidArgument("sampling.tool_choice" if guide.kind == "structural"
                                  else "sampling.guide", str(exc)) from None
    sampling = _sampling(request.sampling, len(ids), rules, guide)
    sig = request.tenant
    tool_format = None
    if (request.WhichOneof("prompt") == "chat" and request.chat.tools
            and request.sampling.tool_choice != "none" and rules.chat_template is not None):
        tool_format = rules.chat_template.tool_format
    return WorkItem(request_id=request_id, trace_id=trace_id, tenant=tenant,
                    user_id=sig.user_id, sharing_scope=sig.compliance_scope or "default",
                    qos_tier=QOS_NAMES.get(sig.qos_tier, "silver"), adapter=adapter,
                    prompt_ids=ids, sampling=sampling, returned=max(request.sampling.n, 1),
                    echo=request.sampling.echo, tool_format=tool_format)
