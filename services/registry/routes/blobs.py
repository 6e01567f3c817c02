"""Blob downloads for workers on hosts without a shared blob store.

A blob that only purged versions reference is refused (404 `purged`), even while its
bytes are still on disk: the purge rule of `services.catalog.serving`. Every download is
logged (digest, outcome), so an operator can show which files left the registry."""

from __future__ import annotations

import base64
import logging
from collections.abc import Iterator
from typing import Annotated

from fastapi import APIRouter, Path
from fastapi.responses import StreamingResponse

from services.catalog.serving import erased_blob_reason
from services.contracts.events import SHA256_PATTERN
from services.contracts.problems import ProblemError, problem_responses
from services.registry.blobstore import BlobCorrupted, BlobNotFound
from services.registry.deps import BlobReader, Blobs, Node

log = logging.getLogger("loraplane.registry")
router = APIRouter(prefix="/v1/blobs", tags=["blobs"])


@router.get("/sha256/{digest}", responses={
    **problem_responses(401, 403, 404, 500),
    200: {"content": {"application/octet-stream": {}}}})
def get_blob(digest: Annotated[str, Path(pattern=SHA256_PATTERN)], principal: BlobReader,
             blobs: Blobs, node: Node) -> StreamingResponse:
    """Stream a blob, never bytes that do not match its digest.

    The blob is hashed before anything is sent: a corrupt one answers 500
    `blob_corrupted` and sends nothing. The stream checks every byte again and holds
    back its last chunk until the digest is right, so a blob that changed in between
    ends short of its Content-Length: the client sees an error, not a blob."""
    with node.state_lock:
        erased = erased_blob_reason(node.state, digest)
    if erased:
        node.metrics.commands.labels("blob_read", "purged").inc()
        log.info("blob %s refused to %s: purged", digest, principal.actor)
        raise ProblemError(404, "purged", erased)
    try:
        size = blobs.verify(digest)
        chunks = blobs.read(digest)
    except BlobNotFound:
        log.info("blob %s refused to %s: not found", digest, principal.actor)
        raise ProblemError(404, "not_found", f"blob {digest} not found") from None
    except BlobCorrupted as exc:
        node.metrics.commands.labels("blob_read", "corrupt").inc()
        log.error("%s", exc)
        raise ProblemError(500, "blob_corrupted", f"{exc}; nothing was sent. Publish the "
                           "adapter again to restore it (same bytes, same name).") from exc

    def stream() -> Iterator[bytes]:
        try:
            yield from chunks
        except BlobCorrupted as exc:
            node.metrics.commands.labels("blob_read", "corrupt").inc()
            log.error("%s; the download was cut short", exc)
            raise

    node.metrics.commands.labels("blob_read", "ok").inc()
    log.info("blob %s sent to %s (%d bytes)", digest, principal.actor, size)
    return StreamingResponse(stream(), media_type="application/octet-stream", headers={
        "Content-Length": str(size), "ETag": f'"{digest}"',
        "Repr-Digest": f"sha-256=:{base64.b64encode(bytes.fromhex(digest)).decode()}:"})
