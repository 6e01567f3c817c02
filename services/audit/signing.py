"""The Ed25519 key that signs Merkle checkpoints.

`LORAPLANE_AUDIT_SIGNING_KEY` (the 32-byte seed, hex) is the production setting: the
key then lives wherever the operator keeps secrets and its public half is what auditors
pin. When it is unset, the first process that needs it generates one and persists the
seed in `<state_dir>/audit-signing-key` (mode 0600), logging a warning with the public
key. That keeps `loraplane up` zero-configuration while never signing with a key that is
lost at restart (a lost key would leave earlier checkpoints unverifiable against a
pinned key). Refusing to start would be the stricter choice; the warning says how to
opt into it (set the variable).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from services.config import Settings

log = logging.getLogger(__name__)

KEY_FILE_NAME = "audit-signing-key"


class SigningKeyError(ValueError):
    """The configured or persisted key is not a 32-byte Ed25519 seed in hex."""


@dataclass(frozen=True)
class CheckpointSigner:
    private_key: Ed25519PrivateKey
    source: str

    @property
    def public_key(self) -> bytes:
        return self.private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def sign(self, message: bytes) -> bytes:
        return self.private_key.sign(message)


def _from_seed_hex(text: str, source: str) -> CheckpointSigner:
    try:
        seed = bytes.fromhex(text.strip())
    except ValueError as exc:
        raise SigningKeyError(f"{source}: audit signing key is not hex") from exc
    if len(seed) != 32:
        raise SigningKeyError(f"{source}: audit signing key must be 32 bytes, got {len(seed)}")
    return CheckpointSigner(Ed25519PrivateKey.from_private_bytes(seed), source)


def key_file(settings: Settings) -> Path:
    return settings.state_dir / KEY_FILE_NAME


def load_signer(settings: Settings, *, create: bool = True) -> CheckpointSigner:
    """The configured key, else the persisted one, else (if `create`) a new persisted one."""
    if settings.audit_signing_key:
        return _from_seed_hex(settings.audit_signing_key, "LORAPLANE_AUDIT_SIGNING_KEY")
    path = key_file(settings)
    if path.exists():
        return _from_seed_hex(path.read_text(), str(path))
    if not create:
        raise SigningKeyError("no audit signing key: set LORAPLANE_AUDIT_SIGNING_KEY")
    path.parent.mkdir(parents=True, exist_ok=True)
    seed = os.urandom(32)
    tmp = path.with_name(f".{KEY_FILE_NAME}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(seed.hex() + "\n")
    try:
        os.link(tmp, path)  # atomic and refuses to overwrite: a concurrent creator wins
    except FileExistsError:
        return _from_seed_hex(path.read_text(), str(path))
    finally:
        tmp.unlink()
    signer = _from_seed_hex(seed.hex(), str(path))
    log.warning("LORAPLANE_AUDIT_SIGNING_KEY is unset: generated an Ed25519 checkpoint key and "
                "saved its seed in %s; public key %s. Set the variable to use a managed key.",
                path, signer.public_key.hex())
    return signer
