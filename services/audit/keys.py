"""Per-tenant data keys: they seal personal fields, and destroying one erases them.

Each tenant gets a random 256-bit data key the first time a personal value of theirs is
sealed (`services.audit.sealing`). The key is stored in `tenant_keys` wrapped (RFC 3394
AES key wrap) by the key-encryption key, which is a setting or a file under the state
dir (`services.audit.signing.load_secret`), never in the database. When the projector
folds a tenant's `TenantPurgeRequested`, the same transaction destroys every live key of
the tenant: the wrapped bytes are overwritten with NULL and the row records when and by
which purge (`purge_proofs` shows it). From then on, personal values of that tenant dated
at or before the purge are stored as `[erased]`; later ones get a new key (a new
generation), so a tenant that comes back is sealed afresh.

The purge transaction commits synchronously, and `tenant_keys` is vacuumed right after,
so the old row versions holding the wrapped key leave the table's pages. What the store
cannot take back: backups and WAL archives made before the purge still hold the wrapped
key; keep the KEK out of them (it is not in the database), or rotate it.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCMSIV
from cryptography.hazmat.primitives.keywrap import InvalidUnwrap, aes_key_unwrap, aes_key_wrap
from sqlalchemy import Connection, Engine, func, select, text, update

from services.audit.sealing import DataKey
from services.audit.signing import load_secret
from services.audit.tables import purges, tenant_keys
from services.config import Settings
from services.contracts.events import TenantRef

log = logging.getLogger(__name__)

KEK_FILE_NAME = "audit-kek"


class KeyUnavailable(RuntimeError):
    """A wrapped key that this KEK does not open (another KEK, or tampered)."""


@dataclass(frozen=True)
class Kek:
    secret: bytes

    @property
    def kek_id(self) -> str:
        return hashlib.sha256(b"loraplane-kek-id\n" + self.secret).hexdigest()[:16]

    def wrap(self, key: bytes) -> bytes:
        return aes_key_wrap(self.secret, key)

    def unwrap(self, wrapped: bytes, kek_id: str, key_id: str) -> bytes:
        if kek_id != self.kek_id:
            raise KeyUnavailable(f"data key {key_id} is wrapped by KEK {kek_id}, this process "
                                 f"holds KEK {self.kek_id}: set LORAPLANE_AUDIT_KEK")
        try:
            return aes_key_unwrap(self.secret, wrapped)
        except InvalidUnwrap as exc:
            raise KeyUnavailable(f"data key {key_id} does not unwrap (tampered)") from exc


def load_kek(settings: Settings) -> Kek:
    secret, _ = load_secret(settings, "audit_kek", KEK_FILE_NAME)
    return Kek(secret)


TenantKey = tuple[str, str, str]
"""(org, team, project)"""


@dataclass
class KeyRing:
    """The projector's keys: the live key of each tenant and each tenant's last purge,
    plus the key rows to insert and destroy with the batch being prepared. Like the fold
    state, it runs ahead of what is committed and is reloaded after any failure."""

    kek: Kek
    live: dict[TenantKey, DataKey] = field(default_factory=dict)
    purged_at: dict[TenantKey, datetime] = field(default_factory=dict)
    created: list[dict[str, Any]] = field(default_factory=list)
    destroyed: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def load(cls, conn: Connection, kek: Kek) -> KeyRing:
        ring = cls(kek)
        for r in conn.execute(select(tenant_keys).where(tenant_keys.c.destroyed_at.is_(None))):
            tenant = (r.tenant_org, r.tenant_team, r.tenant_project)
            key = kek.unwrap(bytes(r.wrapped_key), r.kek_id, r.key_id)
            ring.live[tenant] = DataKey(r.key_id, "/".join(tenant), AESGCMSIV(key))
        for r in conn.execute(select(purges.c.tenant_org, purges.c.tenant_team,
                                     purges.c.tenant_project,
                                     func.max(purges.c.requested_at).label("at"))
                              .group_by(purges.c.tenant_org, purges.c.tenant_team,
                                        purges.c.tenant_project)):
            if r.tenant_org is not None:
                ring.purged_at[(r.tenant_org, r.tenant_team, r.tenant_project)] = r.at
        return ring

    def key_for(self, tenant: TenantRef, dated: datetime) -> DataKey | None:
        """The key sealing `tenant`'s value dated `dated`; None once a purge after that
        date destroyed it."""
        name = (tenant.org, tenant.team, tenant.project)
        purged = self.purged_at.get(name)
        if purged is not None and dated <= purged:
            return None
        key = self.live.get(name)
        if key is None:
            raw = AESGCMSIV.generate_key(256)
            key = self.live[name] = DataKey(secrets.token_hex(8), "/".join(name), AESGCMSIV(raw))
            self.created.append({"key_id": key.key_id, "tenant_org": tenant.org,
                                 "tenant_team": tenant.team, "tenant_project": tenant.project,
                                 "kek_id": self.kek.kek_id, "wrapped_key": self.kek.wrap(raw)})
        return key

    def destroy(self, tenant: TenantRef, purge_id: str, requested_at: datetime) -> None:
        """Forget the tenant's key now; the batch's transaction destroys the stored one."""
        name = (tenant.org, tenant.team, tenant.project)
        prior = self.purged_at.get(name)
        if prior is not None and requested_at < prior:
            return  # an older purge read late: keys made since the newer one stay
        self.purged_at[name] = requested_at
        key = self.live.pop(name, None)
        if key is not None:
            self.destroyed.append({"key_id": key.key_id, "purge_id": purge_id})

    def take_changes(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        changes = (self.created, self.destroyed)
        self.created, self.destroyed = [], []
        return changes


def write_key_changes(conn: Connection, created: list[dict[str, Any]],
                      destroyed: list[dict[str, Any]]) -> None:
    """Destroy the purged tenants' keys, then insert the new ones, in the batch's
    transaction (a batch destroys before it creates: `KeyRing` folds its purges first)."""
    for d in destroyed:
        conn.execute(update(tenant_keys).where(
            tenant_keys.c.key_id == d["key_id"], tenant_keys.c.destroyed_at.is_(None),
        ).values(wrapped_key=None, destroyed_at=func.clock_timestamp(),
                 destroyed_by_purge=d["purge_id"]))
    if created:
        conn.execute(tenant_keys.insert(), created)


def vacuum_keys(engine: Engine) -> None:
    """Drop the dead row versions that still hold destroyed wrapped keys (best effort)."""
    try:
        with engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT").execute(
                text("VACUUM tenant_keys"))
    except Exception as exc:  # the key is destroyed either way; this only tidies pages
        log.warning("VACUUM tenant_keys failed: %s", exc)


class KeyVault:
    """Keys by id for reading sealed values back (`audit reveal`, replay, against-kafka)."""

    def __init__(self, engine: Engine, kek: Kek) -> None:
        self.engine = engine
        self.kek = kek
        self._keys: dict[str, AESGCMSIV | None] = {}

    def __call__(self, key_id: str) -> AESGCMSIV | None:
        if key_id not in self._keys:
            with self.engine.connect() as conn:
                row = conn.execute(select(tenant_keys).where(
                    tenant_keys.c.key_id == key_id)).first()
            if row is None:
                raise KeyUnavailable(f"no data key {key_id} in tenant_keys")
            self._keys[key_id] = (None if row.wrapped_key is None else AESGCMSIV(
                self.kek.unwrap(bytes(row.wrapped_key), row.kek_id, key_id)))
        return self._keys[key_id]
