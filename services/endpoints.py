"""Following the active registry from a list of URLs: one transport every HTTP client of
the registry uses (the CLI's `RegistryClient`, the canary controller, workers' blob
fetches), so they all move between an active registry and its standbys by one rule.

A request goes to the registry that answered last. It moves on to the next URL when:
- nothing answers (connection refused or timed out): nothing was sent;
- the answer is 503 with `outcome: not_written` (a standby, a fenced instance, one still
  replaying): the registry says the command never reached the log, so sending it to
  another instance cannot do it twice;
- a request that is safe to send twice (GET, HEAD, or one with an `Idempotency-Key`) got
  no answer after it was sent (read timeout, connection reset).
Any other answer, 503s whose outcome is unknown included, goes back to the caller as it
is: whether to retry is the caller's decision (with its Idempotency-Key).
"""

from __future__ import annotations

import json
import ssl
import threading
from collections.abc import Sequence

import httpx

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class RegistryFailover(httpx.BaseTransport):
    def __init__(self, urls: Sequence[str], transport: httpx.BaseTransport | None = None) -> None:
        if not urls:
            raise ValueError("no registry URL")
        self.urls = [httpx.URL(u.rstrip("/")) for u in urls]
        self._inner = transport or httpx.HTTPTransport()
        self._current = 0
        self._lock = threading.Lock()

    @property
    def current(self) -> str:
        """The URL of the registry that answered last."""
        return str(self.urls[self._current])

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        with self._lock:
            start = self._current
        resendable = (request.method in SAFE_METHODS
                      or "idempotency-key" in request.headers)
        count = len(self.urls)
        failure: Exception | None = None
        refused: httpx.Response | None = None  # a `not_written` 503 passed over
        for step in range(count):
            index = (start + step) % count
            self._aim(request, self.urls[index])
            try:
                response = self._inner.handle_request(request)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                failure = exc
                continue
            except (httpx.ReadTimeout, httpx.WriteTimeout, httpx.ReadError,
                    httpx.RemoteProtocolError) as exc:
                if not resendable:
                    raise
                failure = exc
                continue
            if step < count - 1 and response.status_code == 503 and not_written(response):
                response.close()  # its body is read: still answerable below
                refused = response
                continue
            with self._lock:
                self._current = index
            return response
        if refused is not None:  # a standby said why, where the rest did not answer
            return refused
        assert failure is not None
        raise failure

    @staticmethod
    def _aim(request: httpx.Request, base: httpx.URL) -> None:
        request.url = request.url.copy_with(scheme=base.scheme, host=base.host, port=base.port)
        request.headers["Host"] = request.url.netloc.decode("ascii")

    def close(self) -> None:
        self._inner.close()


def not_written(response: httpx.Response) -> bool:
    """The registry says the command never reached the log (a standby, a fenced instance,
    one still replaying)."""
    try:
        body = json.loads(response.read())
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("outcome") == "not_written"


def registry_client(urls: Sequence[str], *, headers: dict[str, str] | None = None,
                    timeout: httpx.Timeout | float = 30.0,
                    connect_timeout_s: float = 3.0,
                    verify: ssl.SSLContext | bool = True) -> httpx.Client:
    """An httpx client over `RegistryFailover`; paths are relative to whichever registry
    answers. A registry host that is unreachable costs `connect_timeout_s`, not `timeout`.
    `verify` checks https registries (`services.tls.client_ssl_context`)."""
    if not isinstance(timeout, httpx.Timeout):
        timeout = httpx.Timeout(timeout, connect=connect_timeout_s)
    return httpx.Client(base_url=urls[0], headers=headers or {}, timeout=timeout,
                        transport=RegistryFailover(urls, httpx.HTTPTransport(verify=verify)))
