"""The blob tier: the registry's content-addressed store, `GET /v1/blobs/sha256/{digest}`.

The worker authenticates with its own bearer token (role `worker`, which may read blobs
and nothing else). Bytes are never trusted because of where they came from: the loader
checks them against the published digest (`AdapterFiles.verify`) like bytes from any
other tier. Transient failures (connection refused, 5xx, timeouts) are retried a few
times with backoff and then reported as `BlobUnavailable`; a missing blob, a refused token
or a copy the registry found corrupted (RFC 9457 problem `blob_corrupted`) is reported at
once, because retrying cannot fix it.
"""

from __future__ import annotations

import json
import ssl

import httpx
from tenacity import (
    retry,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
)


class BlobUnavailable(Exception):
    """The registry could not hand out the blob now; a later try may work."""


class BlobMissing(Exception):
    """The registry has no such blob, refuses this worker's token, or sent bytes that do not
    hash to the digest asked for: retrying won't help (a gate that needs it fails)."""


class BlobCorrupted(Exception):
    """The registry's stored copy no longer hashes to its name, so it sends nothing (500
    `blob_corrupted`). Retrying won't help until the adapter is published again."""


class RegistryBlobs:
    """A small client for the registry's blob route (thread-safe: httpx.Client is)."""

    def __init__(self, base_url: str, token: str | None, *, timeout_s: float = 30.0,
                 max_bytes: int = 1 << 31, attempts: int = 3,
                 verify: ssl.SSLContext | bool = True) -> None:
        """`base_url`: one registry, or several separated by commas (an active one and its
        standbys: `services.endpoints` moves on to the next that answers)."""
        from services.endpoints import registry_client

        headers = {"Authorization": f"Bearer {token}"} if token else {}
        urls = [u.strip().rstrip("/") for u in base_url.split(",") if u.strip()]
        self.base_url = urls[0]
        self.max_bytes = max_bytes
        self._client = registry_client(urls, headers=headers, verify=verify,
                                       timeout=httpx.Timeout(timeout_s, connect=5.0))
        self._retrying = retry(
            retry=retry_if_exception_type(BlobUnavailable),
            stop=stop_after_attempt(attempts),
            wait=wait_exponential(multiplier=0.2, max=2.0),
            reraise=True,
        )(self._fetch_once)

    def fetch(self, digest: str) -> bytes:
        """The blob's bytes (unchecked: the caller verifies them against the digest)."""
        return self._retrying(digest)

    def _fetch_once(self, digest: str) -> bytes:
        try:
            with self._client.stream("GET", f"/v1/blobs/sha256/{digest}") as response:
                if response.status_code in (401, 403):
                    raise BlobMissing(f"registry refused the worker token for blob {digest} "
                                      f"({response.status_code}): set LORAPLANE_WORKER_TOKEN "
                                      "to a token with the worker role")
                if response.status_code == 404:
                    raise BlobMissing(f"registry has no blob {digest}")
                if response.status_code != 200:
                    problem = _problem(response)
                    if problem.get("code") == "blob_corrupted":
                        raise BlobCorrupted(problem.get("detail") or f"blob {digest} is "
                                            "corrupted in the registry's store")
                    raise BlobUnavailable(f"registry answered {response.status_code} for "
                                          f"blob {digest}: {problem.get('detail', '')}")
                chunks = []
                size = 0
                for chunk in response.iter_bytes():
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise BlobMissing(f"blob {digest} is larger than {self.max_bytes} "
                                          "bytes")
                    chunks.append(chunk)
                return b"".join(chunks)
        except httpx.HTTPError as exc:
            raise BlobUnavailable(f"cannot fetch blob {digest} from {self.base_url}: "
                                  f"{exc.__class__.__name__}: {exc}") from exc

    def close(self) -> None:
        self._client.close()


def _problem(response: httpx.Response) -> dict[str, object]:
    """The RFC 9457 problem of an error answer, or {} when it has none."""
    try:
        body = json.loads(response.read() or b"{}")
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}

