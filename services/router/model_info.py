"""What a caller may learn about a model: its tokens, and the models it may use.

`Tokenize` and `Detokenize` are tenant-scoped like `Generate`: the model is resolved for
the caller's tenant by the same `Dispatcher.decide` (another tenant's adapter reads as a
missing one, a rate limit applies), and a worker that serves its base model answers.
`ModelInfo` is answered from the router's fold: the base models, and the caller's
servable adapters and aliases with their `parent` base model, as `/v1/models` lists them.
"""

from __future__ import annotations

from typing import Any

import grpc

from services.catalog.auth import Principal
from services.catalog.state import CatalogState
from services.contracts.events import TenantRef
from services.contracts.grpc import inference_pb2 as pb
from services.contracts.grpc import inference_pb2_grpc as pb_grpc
from services.router.dispatch import Dispatcher, RouteError, asked_of

MAX_TOKENIZE_IDS = 1_000_000


async def on_worker(dispatcher: Dispatcher, principal: Principal, signature: pb.TenantSignature,
                    adapter: pb.AdapterRef, base_model: str | None, method: str,
                    request: Any, timeout_s: float = 30.0) -> Any:
    """Resolve the model for the caller and ask one of its workers (RouteError else)."""
    now = dispatcher.clock()
    decision = await dispatcher.decide_caught_up(
        principal, asked_of(signature, adapter, base_model or None), now, now + timeout_s)
    worker = decision.placement.worker
    address = dispatcher.membership.address(worker)
    stub = pb_grpc.InferenceStub(dispatcher._channel(worker, address))
    try:
        return await getattr(stub, method)(request, timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        raise RouteError(exc.code().name, f"worker {worker}: {exc.details() or ''}",
                         "worker_error") from None


def model_entries(catalog: CatalogState, tenant: TenantRef, listed: list[dict[str, Any]]
                  ) -> list[pb.ModelEntry]:
    limits = {b.name: (b.digest, b.config.get("max_position_embeddings"))
              for b in catalog.base_models.values()}
    out = []
    for m in listed:
        base = m.get("parent") or m["id"]
        digest, context = limits.get(base, ("", None))
        out.append(pb.ModelEntry(id=m["id"], parent=m.get("parent") or "",
                                 base_model_digest=digest,
                                 max_model_len=context if isinstance(context, int) else 0,
                                 owned_by=m.get("owned_by", "")))
    return out
