"""Request dependencies: the instance, who is calling, what they may touch, request headers.

Every check that more than one route needs lives here, so a handler reads as the command
it performs: role and tenant scope, If-Match, Idempotency-Key, trace id.

Every route declares the one permission it needs (`Allowed`, from the table in
`services.contracts.roles`); a role without it is 403. Another tenant's adapter, alias,
rollout or purge is answered exactly as a missing one (404, the same words: `foreign`,
mapped by `Refusal.public`), and the registry's log keeps the real reason.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from typing import Annotated

from fastapi import Depends, Header, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel

from services.catalog.auth import Principal, TokenBook
from services.catalog.state import Adapter, RefusalKind, foreign
from services.contracts.codec import canonical_bytes
from services.contracts.events import TenantRef
from services.contracts.problems import ProblemError
from services.contracts.roles import Permission, holders
from services.registry.blobstore import LocalBlobStore
from services.registry.node import Deadline, RegistryNode

bearer = HTTPBearer(auto_error=False, description="A registry token (stored hashed).")


def get_node(request: Request) -> RegistryNode:
    node: RegistryNode = request.app.state.node
    return node


def get_blobs(request: Request) -> LocalBlobStore:
    blobs: LocalBlobStore = request.app.state.blobs
    return blobs


def get_tokens(request: Request) -> TokenBook:
    tokens: TokenBook = request.app.state.tokens
    return tokens


Node = Annotated[RegistryNode, Depends(get_node)]


def require_replayed(node: Node) -> None:
    """503 until the log is replayed: every route that reads the catalog (writes check it
    before they do anything) depends on this, so nothing answers from half a state."""
    node.require_state()


Replayed = Depends(require_replayed)
Blobs = Annotated[LocalBlobStore, Depends(get_blobs)]


def _unauthorized(message: str) -> ProblemError:
    return ProblemError(401, "unauthorized", message,
                        headers={"WWW-Authenticate": 'Bearer realm="loraplane"'})


def current_principal(
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    tokens: Annotated[TokenBook, Depends(get_tokens)],
) -> Principal:
    """401 when no token or an unknown one: the caller is not identified."""
    if credentials is None or not credentials.credentials:
        raise _unauthorized("missing bearer token")
    principal = tokens.resolve(credentials.credentials)
    if principal is None:
        raise _unauthorized("unknown bearer token")
    return principal


class Allowed:
    """A route's permission: 403 when the caller is known but its role lacks it. The
    permission is kept on the dependency so the routes' table can be read back."""

    def __init__(self, permission: Permission) -> None:
        self.permission = permission

    def __call__(
        self, principal: Annotated[Principal, Depends(current_principal)]
    ) -> Principal:
        if not principal.holds(self.permission):
            raise ProblemError(403, "forbidden", f"role {principal.role} may not "
                               f"{self.permission.value} (roles that may: "
                               f"{', '.join(holders(self.permission))})")
        return principal


Writer = Annotated[Principal, Depends(Allowed(Permission.PUBLISH))]
Reader = Annotated[Principal, Depends(Allowed(Permission.READ))]
Purger = Annotated[Principal, Depends(Allowed(Permission.PURGE))]
RolloutStepper = Annotated[Principal, Depends(Allowed(Permission.STEP_ROLLOUT))]
BaseModelRegistrar = Annotated[Principal, Depends(Allowed(Permission.REGISTER_BASE_MODEL))]
ReleaseOverrider = Annotated[Principal, Depends(Allowed(Permission.OVERRIDE_RELEASE))]
BlobReader = Annotated[Principal, Depends(Allowed(Permission.FETCH_BLOB))]


def ensure_write_scope(principal: Principal, tenant: TenantRef | None,
                       permission: Permission = Permission.PUBLISH) -> None:
    """For a tenant the request itself names (a publish form, a purge): 403 when the
    token does not cover it. Nothing is learnt about other tenants' names from this."""
    if principal.allows(permission, tenant):
        return
    if tenant is None:
        raise ProblemError(403, "forbidden",
                           "only an admin may change resources without a tenant")
    raise ProblemError(403, "forbidden", f"token is not scoped to tenant {tenant.key}")


def visible(principal: Principal, tenant: TenantRef | None, what: str, name: str, *,
            permission: Permission = Permission.READ, answer: str | None = None,
            answer_kind: RefusalKind = "not_found") -> None:
    """A resource the request names (an adapter, alias, rollout or purge): one the token
    may not `permission` is answered as if it did not exist (`foreign`)."""
    if not principal.allows(permission, tenant):
        raise foreign(what, name, tenant, answer=answer, answer_kind=answer_kind)


def alias_in_scope(principal: Principal, alias: str, owner: TenantRef | None) -> None:
    """An existing alias the request would change: another tenant's is refused as taken
    (409, naming no tenant). Alias names are one namespace across tenants, so that the
    name is in use cannot be hidden from a caller who tries to create it; who uses it is."""
    if owner is None:
        ensure_write_scope(principal, None)
    visible(principal, owner, "alias", alias, permission=Permission.PUBLISH,
            answer=f"alias {alias!r} is taken: alias names are unique across tenants",
            answer_kind="conflict")


def writable_adapter(node: RegistryNode, principal: Principal, adapter_id: str) -> Adapter:
    """The adapter, if it exists and the caller may change it (404 alike otherwise)."""
    with node.state_lock:
        adapter = node.state.adapter(adapter_id)
    visible(principal, adapter.tenant, "adapter", adapter_id, permission=Permission.PUBLISH)
    return adapter


_ETAG = re.compile(r'^(?:W/)?"?(\d{1,18})"?$')


def expected_version(
    if_match: Annotated[str | None, Header(
        alias="If-Match", description="The resource's etag (stream version), e.g. \"3\"")] = None,
) -> int | None:
    """If-Match as an integer stream version; `*` or absent means no precondition."""
    if if_match is None or if_match.strip() == "*":
        return None
    m = _ETAG.match(if_match.strip())
    if m is None:
        raise ProblemError(412, "precondition", f"If-Match {if_match!r} is not an etag of "
                           'this resource: send the ETag it answered, e.g. "3"',
                           field="If-Match header")
    return int(m[1])


def idempotency_key(
    key: Annotated[str | None, Header(
        alias="Idempotency-Key", max_length=128, pattern=r"^[\x21-\x7e]+$",
        description="Retrying with the same key returns the first answer, emits nothing")
    ] = None,
) -> str | None:
    return key or None


_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}$")


def trace_id(
    traceparent: Annotated[str | None, Header(description="W3C trace context")] = None,
) -> str:
    m = _TRACEPARENT.match(traceparent or "")
    if m and m[1] != "0" * 32:
        return m[1]
    return uuid.uuid4().hex


def write_deadline(node: Node) -> Deadline:
    """A write's deadline starts once its request is read (before any check or queue)."""
    return Deadline(node.settings.registry_write_timeout_s)


def request_fingerprint(command: str, *parts: object) -> str:
    """SHA-256 of what makes a request the one it is, for Idempotency-Key reuse checks
    (IETF Idempotency-Key draft: a key reused with another request is refused)."""
    plain = [p.model_dump(mode="json") if isinstance(p, BaseModel) else p for p in parts]
    return hashlib.sha256(canonical_bytes({"command": command, "parts": plain})).hexdigest()


ExpectedVersion = Annotated[int | None, Depends(expected_version)]
IdempotencyKey = Annotated[str | None, Depends(idempotency_key)]
TraceId = Annotated[str, Depends(trace_id)]
WriteDeadline = Annotated[Deadline, Depends(write_deadline)]
