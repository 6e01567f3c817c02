"""Blob downloads for workers on hosts without a shared blob store."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path
from fastapi.responses import StreamingResponse

from services.registry.blobstore import BlobCorrupted, BlobNotFound
from services.registry.deps import BlobReader, Blobs, Node
from services.registry.views import ErrorBody

router = APIRouter(prefix="/v1/blobs", tags=["blobs"])
ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorBody} for code in (401, 403, 404)}


@router.get("/sha256/{digest}", responses={
    **ERRORS, 200: {"content": {"application/octet-stream": {}}}})
def get_blob(digest: Annotated[str, Path(pattern=r"^[0-9a-f]{64}$")], principal: BlobReader,
             blobs: Blobs, node: Node) -> StreamingResponse:
    """Stream a blob. Its digest is checked while streaming; on a mismatch the connection is
    cut before the declared length, so a client never mistakes corrupt bytes for a blob."""
    try:
        size = blobs.size(digest)
        chunks = blobs.read(digest)
    except BlobNotFound:
        raise HTTPException(404, f"blob {digest} not found") from None

    def stream() -> Iterator[bytes]:
        try:
            yield from chunks
        except BlobCorrupted:
            node.metrics.commands.labels("blob_read", "corrupt").inc()
            raise

    return StreamingResponse(stream(), media_type="application/octet-stream", headers={
        "Content-Length": str(size), "ETag": f'"{digest}"',
        "Repr-Digest": f"sha-256=:{_b64(digest)}:"})


def _b64(digest: str) -> str:
    import base64

    return base64.b64encode(bytes.fromhex(digest)).decode()
