"""Blob downloads for workers on hosts without a shared blob store."""

from __future__ import annotations

import base64
import logging
from collections.abc import Iterator
from typing import Annotated

from fastapi import APIRouter, Path
from fastapi.responses import StreamingResponse

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
    try:
        size = blobs.verify(digest)
        chunks = blobs.read(digest)
    except BlobNotFound:
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

    return StreamingResponse(stream(), media_type="application/octet-stream", headers={
        "Content-Length": str(size), "ETag": f'"{digest}"',
        "Repr-Digest": f"sha-256=:{base64.b64encode(bytes.fromhex(digest)).decode()}:"})
