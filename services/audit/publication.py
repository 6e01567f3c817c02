"""Where third parties fetch checkpoints without database access: a folder of signed
note files and the projector's HTTP endpoint (the same server as its metrics).

Every checkpoint the projector signs is written, once its transaction has committed
durably, to `<checkpoint dir>/<topic>/<partition>/<tree size>` and `…/latest`, each file a
C2SP signed note exactly as stored (`checkpoints.note`). An auditor or witness keeps
copies; `loraplane audit verify --checkpoint FILE` checks the store against one, and
`audit consistency OLD NEW` proves a newer log extends it. The HTTP server answers:

    GET /checkpoints                                 JSON index of the logs and their sizes
    GET /checkpoints/latest                          JSON {origin: latest note}
    GET /checkpoints/{topic}/{partition}/latest      the latest note (text/plain)
    GET /checkpoints/{topic}/{partition}/{size}      the note of that size
    GET /metrics                                     Prometheus metrics of the projector

Files are written to a temporary name, fsynced and renamed, so a reader never sees half
a note; `latest` only ever moves forward.
"""

from __future__ import annotations

import json
import os
import re
import socket
import ssl
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from services.audit.verifier import EvidenceError, parse_checkpoint, split_note

_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointFolder:
    """Signed checkpoint notes on disk, one folder per partition log."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def _dir(self, topic: str, partition: int) -> Path:
        if not _NAME.match(topic) or topic in (".", ".."):
            raise ValueError(f"not a topic name: {topic!r}")
        return self.root / topic / str(int(partition))

    def path(self, topic: str, partition: int, size: int | str) -> Path:
        name = str(size)
        if name != "latest" and not name.isdigit():
            raise ValueError(f"not a tree size: {size!r}")
        return self._dir(topic, partition) / name

    def publish(self, topic: str, partition: int, size: int, note: str) -> None:
        target = self.path(topic, partition, size)
        if not target.exists():
            _write_atomically(target, note)
        latest = self.path(topic, partition, "latest")
        if self._size_of(latest) < size:
            _write_atomically(latest, note)

    @staticmethod
    def _size_of(path: Path) -> int:
        try:
            text, _ = split_note(path.read_text(encoding="utf-8"))
            return parse_checkpoint(text).size
        except (OSError, EvidenceError, UnicodeDecodeError):
            return -1

    def read(self, topic: str, partition: int, size: int | str) -> str | None:
        try:
            return self.path(topic, partition, size).read_text(encoding="utf-8")
        except (OSError, ValueError):
            return None

    def logs(self) -> Iterator[tuple[str, int, str]]:
        """(topic, partition, latest note) of every log with a checkpoint."""
        if not self.root.is_dir():
            return
        for topic_dir in sorted(p for p in self.root.iterdir() if p.is_dir()):
            for part_dir in sorted((p for p in topic_dir.iterdir() if p.name.isdigit()),
                                   key=lambda p: int(p.name)):
                note = self.read(topic_dir.name, int(part_dir.name), "latest")
                if note is not None:
                    yield topic_dir.name, int(part_dir.name), note


Wsgi = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def http_app(folder: CheckpointFolder, registry: CollectorRegistry) -> Wsgi:
    """One WSGI app: /checkpoints… from the folder, everything else is /metrics."""
    metrics = make_wsgi_app(registry)

    def answer(start_response: Callable[..., Any], status: str, body: bytes,
               content_type: str) -> list[bytes]:
        start_response(status, [("Content-Type", content_type),
                                ("Content-Length", str(len(body))),
                                ("Cache-Control", "no-cache")])
        return [body]

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return metrics(environ, start_response)
        if path != "/checkpoints" and not path.startswith("/checkpoints/"):
            return answer(start_response, "404 Not Found", b"/metrics or /checkpoints\n",
                          "text/plain; charset=utf-8")
        parts = [p for p in path.split("/") if p][1:]
        if parts in ([], ["latest"]):
            logs = list(folder.logs())
            if parts:
                body = {parse_checkpoint(split_note(n)[0]).origin: n for _, _, n in logs}
            else:
                body = {"logs": [{"topic": t, "partition": p,
                                  "origin": parse_checkpoint(split_note(n)[0]).origin,
                                  "size": parse_checkpoint(split_note(n)[0]).size,
                                  "latest": f"/checkpoints/{t}/{p}/latest"}
                                 for t, p, n in logs]}
            return answer(start_response, "200 OK", json.dumps(body, indent=2).encode(),
                          "application/json")
        if len(parts) == 3 and parts[1].isdigit():
            try:
                note = folder.read(parts[0], int(parts[1]), parts[2])
            except ValueError:
                note = None
            if note is not None:
                return answer(start_response, "200 OK", note.encode(),
                              "text/plain; charset=utf-8")
        return answer(start_response, "404 Not Found", b"no such checkpoint\n",
                      "text/plain; charset=utf-8")

    return app


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes every few seconds would flood stderr; requests are not evidence."""


class _TlsWSGIServer(ThreadingWSGIServer):
    """Each accepted connection is wrapped in TLS; the handshake runs on the first read
    in the connection's own thread, so a client that never speaks holds no other up."""

    ssl_context: ssl.SSLContext

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, address = super().get_request()
        return self.ssl_context.wrap_socket(sock, server_side=True,
                                            do_handshake_on_connect=False), address

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A refused handshake (no certificate, an untrusted one) is the client's error:
        not a traceback on the projector's stderr."""
        if isinstance(sys.exc_info()[1], (ssl.SSLError, ConnectionError)):
            return
        super().handle_error(request, client_address)


class HttpEndpoint:
    """The projector's HTTP server in a daemon thread; `port` is the one bound. With an
    SSL context it serves HTTPS (`services.tls`: mutual TLS and rotation included)."""

    def __init__(self, host: str, port: int, app: Wsgi,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        server_class: type[WSGIServer] = ThreadingWSGIServer
        if ssl_context is not None:
            server_class = type("TlsServer", (_TlsWSGIServer,), {"ssl_context": ssl_context})
        self._server: WSGIServer = make_server(host, port, app, server_class,
                                               handler_class=_QuietHandler)
        self.port = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="audit-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
