from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper

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
QOS_TIER_UNSPECIFIED: QosTier
QOS_TIER_BRONZE: QosTier
QOS_TIER_SILVER: QosTier
QOS_TIER_GOLD: QosTier
QOS_TIER_PLATINUM: QosTier
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_ABORTED: FinishReason

class TenantSignature(_message.Message):
    __slots__ = ("compliance_scope", "org_id", "project_id", "qos_tier", "region_hint", "team_id", "user_id")
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
    def __init__(self, org_id: str | None = ..., team_id: str | None = ..., project_id: str | None = ..., user_id: str | None = ..., compliance_scope: str | None = ..., region_hint: str | None = ..., qos_tier: QosTier | str | None = ...) -> None: ...

class AdapterRef(_message.Message):
    __slots__ = ("alias", "pinned")
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    alias: str
    pinned: PinnedVersion
    def __init__(self, alias: str | None = ..., pinned: PinnedVersion | _Mapping | None = ...) -> None: ...

class PinnedVersion(_message.Message):
    __slots__ = ("adapter_id", "version")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    version: int
    def __init__(self, adapter_id: str | None = ..., version: int | None = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "seed", "stop", "temperature", "top_p")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, max_tokens: int | None = ..., temperature: float | None = ..., top_p: float | None = ..., seed: int | None = ..., stop: _Iterable[str] | None = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("adapter", "request_id", "sampling", "tenant", "text", "token_ids", "trace_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: TenantSignature
    adapter: AdapterRef
    text: str
    token_ids: TokenIds
    sampling: SamplingParams
    trace_id: str
    def __init__(self, request_id: str | None = ..., tenant: TenantSignature | _Mapping | None = ..., adapter: AdapterRef | _Mapping | None = ..., text: str | None = ..., token_ids: TokenIds | _Mapping | None = ..., sampling: SamplingParams | _Mapping | None = ..., trace_id: str | None = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Iterable[int] | None = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("final", "token")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    token: TokenChunk
    final: FinalUsage
    def __init__(self, token: TokenChunk | _Mapping | None = ..., final: FinalUsage | _Mapping | None = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("index", "text", "token_id")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_id: int
    text: str
    def __init__(self, index: int | None = ..., token_id: int | None = ..., text: str | None = ...) -> None: ...

class ServedAdapter(_message.Message):
    __slots__ = ("adapter_id", "sha256", "version")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    version: int
    sha256: str
    def __init__(self, adapter_id: str | None = ..., version: int | None = ..., sha256: str | None = ...) -> None: ...

class FinalUsage(_message.Message):
    __slots__ = ("base_model_digest", "cached_prompt_tokens", "completion_tokens", "finish_reason", "prompt_tokens", "served_adapter", "time_to_first_token_ms", "total_ms", "trace_id", "worker_id")
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
    def __init__(self, prompt_tokens: int | None = ..., completion_tokens: int | None = ..., cached_prompt_tokens: int | None = ..., served_adapter: ServedAdapter | _Mapping | None = ..., base_model_digest: str | None = ..., trace_id: str | None = ..., worker_id: str | None = ..., finish_reason: FinishReason | str | None = ..., time_to_first_token_ms: float | None = ..., total_ms: float | None = ...) -> None: ...
