"""TLS and mutual TLS for every loraplane listener and client, from settings.

One certificate and key per process (`LORAPLANE_TLS_CERT_FILE`, `_KEY_FILE`): every
listener it has serves them (router gRPC and HTTP, worker gRPC, registry HTTP, the
projector's checkpoints), and its clients present them where a peer asks for a client
certificate. `LORAPLANE_TLS_CA_FILE` is what it trusts: clients verify servers against it
(and dial TLS at all only when it is set), and listeners that require client certificates
(`LORAPLANE_TLS_CLIENT_AUTH`: router, worker, registry, audit; mutual TLS per hop) verify
them against it.

Rotation needs no restart: listeners look at the files' modification times at each new
connection and load the new ones when they changed (gRPC through its certificate
fetcher, Python's `ssl` servers by switching a handshake to a fresh context in the SNI
callback, which runs for every ClientHello, SNI or not). A pair that does not load (a
certificate written before its key) keeps the previous one until it does. Connections
already open keep what they were set up with; client channels take new client
certificates on their next connection where their owner rebuilds them.

Without a certificate, everything is plaintext, as `loraplane up` is on loopback.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import grpc

from services.config import Settings

log = logging.getLogger("loraplane.tls")

Hop = Literal["router", "worker", "registry", "audit"]


class TlsConfigError(ValueError):
    """The settings name files that cannot be used: said at start, by setting."""


def serves_tls(settings: Settings) -> bool:
    return settings.tls_cert_file is not None


def dials_tls(settings: Settings) -> bool:
    return settings.tls_ca_file is not None


def mutual(settings: Settings, hop: Hop) -> bool:
    return hop in settings.tls_client_auth


def http_scheme(settings: Settings) -> str:
    """The scheme of URLs a client builds from host and port (a given URL keeps its own)."""
    return "https" if dials_tls(settings) else "http"


@dataclass(frozen=True)
class Material:
    cert: bytes
    key: bytes
    ca: bytes | None


class ReloadingFiles:
    """The process's certificate, key and CA bundle, re-read when a file changes."""

    def __init__(self, cert: Path | None, key: Path | None, ca: Path | None) -> None:
        self.paths = (cert, key, ca)
        self._lock = threading.Lock()
        self._stamp: tuple[tuple[int, int] | None, ...] | None = None
        self._material: Material | None = None
        self.generation = 0
        """Moves each time a changed set of files was loaded."""

    @staticmethod
    def _stat(path: Path | None) -> tuple[int, int] | None:
        if path is None:
            return None
        try:
            info = os.stat(path)
        except OSError:
            return None
        return (info.st_mtime_ns, info.st_size)

    def stamp(self) -> tuple[tuple[int, int] | None, ...]:
        return tuple(self._stat(p) for p in self.paths)

    def current(self) -> tuple[Material, bool]:
        """The material now, and whether it changed since the last call."""
        stamp = self.stamp()
        with self._lock:
            if stamp == self._stamp and self._material is not None:
                return self._material, False
            cert, key, ca = self.paths
            try:
                material = Material(
                    cert.read_bytes() if cert else b"", key.read_bytes() if key else b"",
                    ca.read_bytes() if ca else None)
            except OSError as exc:
                if self._material is None:
                    raise TlsConfigError(f"cannot read TLS files: {exc}") from exc
                log.warning("TLS files unreadable, keeping the previous ones: %s", exc)
                return self._material, False
            self._stamp, self._material = stamp, material
            self.generation += 1
            return material, True


_FILES: dict[tuple[Path | None, ...], ReloadingFiles] = {}


def files_of(settings: Settings) -> ReloadingFiles:
    key = (settings.tls_cert_file, settings.tls_key_file, settings.tls_ca_file)
    found = _FILES.get(key)
    if found is None:
        if (settings.tls_cert_file is None) != (settings.tls_key_file is None):
            raise TlsConfigError("set both LORAPLANE_TLS_CERT_FILE and LORAPLANE_TLS_KEY_FILE "
                                 "(or neither)")
        found = _FILES[key] = ReloadingFiles(*key)
    return found


# --- gRPC --------------------------------------------------------------------------------


def _listener(settings: Settings, hop: Hop) -> tuple[ReloadingFiles, Material, bool]:
    """A TLS listener's files, their current material and whether it requires client
    certificates; mutual TLS without a CA to check them against is a setting error."""
    files = files_of(settings)
    material, _ = files.current()
    required = mutual(settings, hop)
    if required and material.ca is None:
        raise TlsConfigError(f"LORAPLANE_TLS_CLIENT_AUTH names {hop}: set "
                             "LORAPLANE_TLS_CA_FILE to verify client certificates")
    return files, material, required


def _grpc_config(material: Material) -> Any:
    return grpc.ssl_server_certificate_configuration(
        [(material.key, material.cert)], root_certificates=material.ca)


def grpc_server_credentials(settings: Settings, hop: Hop) -> grpc.ServerCredentials | None:
    """Credentials of a TLS gRPC listener whose certificate follows its files; None when
    this process serves plaintext."""
    if not serves_tls(settings):
        return None
    files, material, required = _listener(settings, hop)

    seen = {"generation": files.generation}

    def fetch() -> Any:
        try:
            fresh, _ = files.current()
            if files.generation == seen["generation"]:
                return None
            config = _grpc_config(fresh)
        except Exception:  # a half-written pair: keep serving the previous one
            log.exception("reloading the %s listener's certificate", hop)
            return None
        seen["generation"] = files.generation
        log.info("%s gRPC listener: certificate reloaded", hop)
        return config

    return grpc.dynamic_ssl_server_credentials(_grpc_config(material), fetch,
                                               require_client_authentication=required)


def add_grpc_port(server: grpc.Server | grpc.aio.Server, address: str, settings: Settings,
                  hop: Hop) -> int:
    """Bind `address` with TLS when this process has a certificate; returns the port."""
    credentials = grpc_server_credentials(settings, hop)
    if credentials is None:
        return int(server.add_insecure_port(address))
    return int(server.add_secure_port(address, credentials))


def grpc_channel_credentials(settings: Settings) -> grpc.ChannelCredentials | None:
    """Credentials a client dials with (the process's certificate as its client
    certificate when it has one); None: plaintext."""
    if not dials_tls(settings):
        return None
    material, _ = files_of(settings).current()
    return grpc.ssl_channel_credentials(root_certificates=material.ca,
                                        private_key=material.key or None,
                                        certificate_chain=material.cert or None)


def channel_options(settings: Settings) -> list[tuple[str, Any]]:
    if dials_tls(settings) and settings.tls_server_name:
        return [("grpc.ssl_target_name_override", settings.tls_server_name)]
    return []


def channel_key(address: str, settings: Settings) -> str:
    """What a cached client channel is valid for: the address, and with TLS the files'
    generation (a rotated client certificate makes a new channel)."""
    if not dials_tls(settings):
        return address
    files = files_of(settings)
    files.current()
    return f"{address}#{files.generation}"


def channel(address: str, settings: Settings,
            options: list[tuple[str, Any]] | None = None) -> grpc.Channel:
    credentials = grpc_channel_credentials(settings)
    opts = [*(options or []), *channel_options(settings)]
    if credentials is None:
        return grpc.insecure_channel(address, options=opts)
    return grpc.secure_channel(address, credentials, options=opts)


def aio_channel(address: str, settings: Settings,
                options: list[tuple[str, Any]] | None = None) -> grpc.aio.Channel:
    credentials = grpc_channel_credentials(settings)
    opts = [*(options or []), *channel_options(settings)]
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=opts)
    return grpc.aio.secure_channel(address, credentials, options=opts)


# --- Python ssl (uvicorn, the projector's WSGI server) ----------------------------------


def _server_context(material: Material, required: bool, files: ReloadingFiles) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    cert, key, _ = files.paths
    assert cert is not None and key is not None
    context.load_cert_chain(cert, key)
    if material.ca is not None:
        context.load_verify_locations(cadata=material.ca.decode())
    context.verify_mode = ssl.CERT_REQUIRED if required else ssl.CERT_NONE
    return context


def server_ssl_context(settings: Settings, hop: Hop) -> ssl.SSLContext | None:
    """A server context whose certificate (and trusted CA) follows its files: each
    handshake looks at them, and switches to a fresh context when they changed."""
    if not serves_tls(settings):
        return None
    files, material, required = _listener(settings, hop)
    live = {"context": _server_context(material, required, files),
            "generation": files.generation}
    lock = threading.Lock()

    def pick(connection: Any, _server_name: str | None, _context: ssl.SSLContext) -> None:
        try:
            files.current()
            with lock:
                if files.generation != live["generation"]:
                    fresh, _ = files.current()
                    live["context"] = _server_context(fresh, required, files)
                    live["generation"] = files.generation
                    log.info("%s listener: certificate reloaded", hop)
                chosen = live["context"]
        except (OSError, ssl.SSLError, TlsConfigError):
            log.exception("reloading the %s listener's certificate; keeping the previous", hop)
            with lock:
                chosen = live["context"]
        connection.context = chosen

    front = _server_context(material, required, files)
    front.sni_callback = pick
    return front


def client_ssl_context(settings: Settings) -> ssl.SSLContext | bool:
    """What an HTTP client verifies with: the CA bundle (and presents: the process's
    certificate); True (the system's trust) when no CA is set."""
    if not dials_tls(settings):
        return True
    material, _ = files_of(settings).current()
    context = ssl.create_default_context(cadata=(material.ca or b"").decode())
    cert, key, _ = files_of(settings).paths
    if cert is not None and key is not None:
        context.load_cert_chain(cert, key)
    return context


def uvicorn_ssl(config: Any, settings: Settings, hop: Hop) -> Any:
    """Load a uvicorn Config with the reloading context in place of its own."""
    context = server_ssl_context(settings, hop)
    if context is not None:
        config.ssl_certfile = str(settings.tls_cert_file)
        config.ssl_keyfile = str(settings.tls_key_file)
    config.load()
    config.ssl = context
    return config


def describe(settings: Settings) -> str:
    """One line for start-up logs and `up`: what this process's listeners speak."""
    if not serves_tls(settings):
        return "plaintext (no LORAPLANE_TLS_CERT_FILE)"
    hops = ", ".join(settings.tls_client_auth) or "none"
    return f"TLS with {settings.tls_cert_file} (client certificates required on: {hops})"
