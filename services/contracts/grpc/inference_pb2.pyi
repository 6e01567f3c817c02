from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class QosTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    QOS_TIER_UNSPECIFIED: _ClassVar[QosTier]
    QOS_TIER_BRONZE: _ClassVar[QosTier]
    QOS_TIER_SILVER: _ClassVar[QosTier]
    QOS_TIER_GOLD: _ClassVar[QosTier]
    QOS_TIER_PLATINUM: _ClassVar[QosTier]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_ABORTED: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class PrefetchTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREFETCH_TIER_UNSPECIFIED: _ClassVar[PrefetchTier]
    PREFETCH_TIER_HOST: _ClassVar[PrefetchTier]
    PREFETCH_TIER_DEVICE: _ClassVar[PrefetchTier]
QOS_TIER_UNSPECIFIED: QosTier
QOS_TIER_BRONZE: QosTier
QOS_TIER_SILVER: QosTier
QOS_TIER_GOLD: QosTier
QOS_TIER_PLATINUM: QosTier
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_ABORTED: FinishReason
FINISH_REASON_ERROR: FinishReason
PREFETCH_TIER_UNSPECIFIED: PrefetchTier
PREFETCH_TIER_HOST: PrefetchTier
PREFETCH_TIER_DEVICE: PrefetchTier

class TenantSignature(_message.Message):
    __slots__ = ("org_id", "team_id", "project_id", "user_id", "compliance_scope", "region_hint", "qos_tier")
    ORG_ID_FIELD_NUMBER: _ClassVar[int]
    TEAM_ID_FIELD_NUMBER: _ClassVar[int]
    PROJECT_ID_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    COMPLIANCE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    REGION_HINT_FIELD_NUMBER: _ClassVar[int]
    QOS_TIER_FIELD_NUMBER: _ClassVar[int]
    org_id: str
    team_id: str
    project_id: str
    user_id: str
    compliance_scope: str
    region_hint: str
    qos_tier: QosTier
    def __init__(self, org_id: _Optional[str] = ..., team_id: _Optional[str] = ..., project_id: _Optional[str] = ..., user_id: _Optional[str] = ..., compliance_scope: _Optional[str] = ..., region_hint: _Optional[str] = ..., qos_tier: _Optional[_Union[QosTier, str]] = ...) -> None: ...

class AdapterRef(_message.Message):
    __slots__ = ("alias", "pinned")
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    alias: str
    pinned: PinnedVersion
    def __init__(self, alias: _Optional[str] = ..., pinned: _Optional[_Union[PinnedVersion, _Mapping]] = ...) -> None: ...

class PinnedVersion(_message.Message):
    __slots__ = ("adapter_id", "version")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    version: int
    def __init__(self, adapter_id: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "seed", "stop", "min_tokens", "ignore_eos")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    min_tokens: int
    ignore_eos: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., min_tokens: _Optional[int] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "tenant", "adapter", "text", "token_ids", "chat", "sampling", "trace_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: TenantSignature
    adapter: AdapterRef
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    sampling: SamplingParams
    trace_id: str
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[_Union[TenantSignature, _Mapping]] = ..., adapter: _Optional[_Union[AdapterRef, _Mapping]] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., trace_id: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token", "final")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    token: TokenChunk
    final: FinalUsage
    def __init__(self, token: _Optional[_Union[TokenChunk, _Mapping]] = ..., final: _Optional[_Union[FinalUsage, _Mapping]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("index", "token_id", "text")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_id: int
    text: str
    def __init__(self, index: _Optional[int] = ..., token_id: _Optional[int] = ..., text: _Optional[str] = ...) -> None: ...

class ServedAdapter(_message.Message):
    __slots__ = ("adapter_id", "version", "sha256")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    version: int
    sha256: str
    def __init__(self, adapter_id: _Optional[str] = ..., version: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class FinalUsage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens", "served_adapter", "base_model_digest", "trace_id", "worker_id", "finish_reason", "time_to_first_token_ms", "total_ms")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SERVED_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    served_adapter: ServedAdapter
    base_model_digest: str
    trace_id: str
    worker_id: str
    finish_reason: FinishReason
    time_to_first_token_ms: float
    total_ms: float
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., served_adapter: _Optional[_Union[ServedAdapter, _Mapping]] = ..., base_model_digest: _Optional[str] = ..., trace_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., time_to_first_token_ms: _Optional[float] = ..., total_ms: _Optional[float] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("adapters", "tier", "reason")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[PinnedVersion]
    tier: PrefetchTier
    reason: str
    def __init__(self, adapters: _Optional[_Iterable[_Union[PinnedVersion, _Mapping]]] = ..., tier: _Optional[_Union[PrefetchTier, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class PrefetchStatus(_message.Message):
    __slots__ = ("adapter", "accepted", "tier", "detail")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    adapter: PinnedVersion
    accepted: bool
    tier: str
    detail: str
    def __init__(self, adapter: _Optional[_Union[PinnedVersion, _Mapping]] = ..., accepted: _Optional[bool] = ..., tier: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class PrefetchReply(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[PrefetchStatus]
    def __init__(self, adapters: _Optional[_Iterable[_Union[PrefetchStatus, _Mapping]]] = ...) -> None: ...
