"""The audit store's two secrets: the Ed25519 key that signs checkpoints, and the
key-encryption key (KEK) that wraps the tenants' data keys (`services.audit.keys`).

Each is a setting in production (`LORAPLANE_AUDIT_SIGNING_KEY`, `LORAPLANE_AUDIT_KEK`:
32 bytes in hex), so it lives wherever the operator keeps secrets. When the setting is
unset, the first process that needs the secret generates one and persists it under the
state dir (mode 0600), logging a warning. That keeps `loraplane up` zero-configuration
while never using a secret that is lost at restart: a lost signing key would leave
earlier checkpoints unverifiable against a pinned key, a lost KEK every sealed field
unreadable. Refusing to start would be the stricter choice; the warning says how to opt
into it (set the variable).

Checkpoints are signed as C2SP signed notes (`services.audit.verifier`): each partition
is its own log, whose key name is the log's origin, `<audit_origin>/<topic>/<partition>`
(C2SP: the log's key name SHOULD match the origin line). One Ed25519 key signs every
partition's log; each origin has its own verifier key string (name+hash+key).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from services.audit.verifier import Checkpoint, NoteKey, key_hash, sign_note
from services.config import Settings

log = logging.getLogger(__name__)

KEY_FILE_NAME = "audit-signing-key"
KEK_FILE_NAME = "audit-kek"


class SigningKeyError(ValueError):
    """A configured or persisted secret is not 32 bytes in hex, or none exists."""


def _from_hex(text: str, source: str) -> bytes:
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError as exc:
        raise SigningKeyError(f"{source}: not hex") from exc
    if len(secret) != 32:
        raise SigningKeyError(f"{source}: must be 32 bytes, got {len(secret)}")
    return secret


def load_secret(settings: Settings, setting: str, file_name: str, *,
                create: bool = True) -> tuple[bytes, str]:
    """(32-byte secret, where it came from): the setting, else the file under the state
    dir, else (if `create`) a new random one persisted there."""
    configured = getattr(settings, setting)
    variable = f"LORAPLANE_{setting.upper()}"
    if configured:
        return _from_hex(configured, variable), variable
    path = settings.state_dir / file_name
    if path.exists():
        return _from_hex(path.read_text(), str(path)), str(path)
    if not create:
        raise SigningKeyError(f"no {file_name}: set {variable}")
    path.parent.mkdir(parents=True, exist_ok=True)
    secret = os.urandom(32)
    tmp = path.with_name(f".{file_name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret.hex() + "\n")
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)  # atomic and refuses to overwrite: a concurrent creator wins
    except FileExistsError:
        return _from_hex(path.read_text(), str(path)), str(path)
    finally:
        tmp.unlink()
    log.warning("%s is unset: generated one and saved it in %s (mode 0600). Set the variable "
                "to use a managed secret.", variable, path)
    return secret, str(path)


def log_origin(settings: Settings, topic: str, partition: int) -> str:
    """The origin line (and key name) of one partition's log."""
    return f"{settings.audit_origin}/{topic}/{partition}"


@dataclass(frozen=True)
class CheckpointSigner:
    private_key: Ed25519PrivateKey
    source: str

    @property
    def public_key(self) -> bytes:
        return self.private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def note_key(self, origin: str) -> NoteKey:
        return NoteKey(origin, key_hash(origin, self.public_key), self.public_key)

    def sign(self, checkpoint: Checkpoint) -> str:
        """The checkpoint as a signed note, under the key named like its origin."""
        return sign_note(checkpoint.text(), checkpoint.origin, self.private_key.sign,
                         self.public_key)


def key_file(settings: Settings) -> Path:
    return settings.state_dir / KEY_FILE_NAME


def load_signer(settings: Settings, *, create: bool = True) -> CheckpointSigner:
    """The configured key, else the persisted one, else (if `create`) a new persisted one."""
    seed, source = load_secret(settings, "audit_signing_key", KEY_FILE_NAME, create=create)
    return CheckpointSigner(Ed25519PrivateKey.from_private_bytes(seed), source)
