"""The gRPC front: `loraplane.v1.Inference` as a worker serves it, plus health and reflection.

The caller authenticates with `authorization: Bearer <token>` metadata. Everything else
(the request's check, resolution, placement, limits, failover) is `Dispatcher.generate`;
this module only maps its errors to gRPC statuses. Bytes that are no `GenerateRequest`
(a string field that is not UTF-8) are INVALID_ARGUMENT, not grpc's INTERNAL. A
rate-limit refusal carries trailing metadata `retry-after` (whole seconds, as HTTP's
header) and `retry-after-ms`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services import tls
from services.catalog.auth import Principal, TokenBook
from services.config import Settings
from services.contracts.generate import Undecodable, add_inference_servicer
from services.contracts.grpc import inference_pb2 as pb
from services.contracts.grpc import inference_pb2_grpc as pb_grpc
from services.contracts.roles import Permission, holders
from services.router.dispatch import Dispatcher, RouteError, authorize
from services.router.model_info import model_entries, on_worker

INFERENCE_SERVICE = pb.DESCRIPTOR.services_by_name["Inference"].full_name
RPC_PERMISSIONS: dict[str, Permission] = {
    "Generate": Permission.INFER, "Tokenize": Permission.INFER,
    "Detokenize": Permission.INFER, "ModelInfo": Permission.INFER}
"""Each RPC of the router's Inference service → the permission its caller's role needs
(`services.contracts.roles`); a token whose role lacks it is PERMISSION_DENIED."""


def bearer_of(metadata: object) -> str | None:
    """The token of an `authorization: Bearer …` entry (gRPC metadata keys are lowercase)."""
    for key, value in metadata or ():  # type: ignore[attr-defined]
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(self, dispatcher: Dispatcher, tokens: TokenBook) -> None:
        self.dispatcher = dispatcher
        self.tokens = tokens

    async def _principal(self, context: grpc.aio.ServicerContext, rpc: str) -> Principal:
        token = bearer_of(context.invocation_metadata())
        principal = self.tokens.resolve(token) if token else None
        if principal is None:
            self.dispatcher.metrics.rejections.labels("unauthenticated").inc()
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or unknown bearer token (authorization metadata)")
        assert principal is not None
        permission = RPC_PERMISSIONS[rpc]
        if not principal.holds(permission):
            self.dispatcher.metrics.rejections.labels("forbidden").inc()
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"role {principal.role} may not {permission.value} (roles "
                                f"that may: {', '.join(holders(permission))})")
        return principal

    async def Generate(self, request: pb.GenerateRequest | Undecodable,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        principal = await self._principal(context, "Generate")
        if isinstance(request, Undecodable):
            self.dispatcher.metrics.rejections.labels("invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request: not a loraplane.v1.GenerateRequest: {request.reason}")
        stream = self.dispatcher.generate(principal, request,
                                          timeout_s=context.time_remaining(), front="grpc")
        try:
            async with contextlib.aclosing(stream):
                async for response in stream:
                    yield response
        except RouteError as error:
            if error.retry_after is not None and error.retry_after_s is not None:
                context.set_trailing_metadata((
                    ("retry-after", error.retry_after),
                    ("retry-after-ms", str(max(1, round(error.retry_after_s * 1000)))),
                ))
            await context.abort(grpc.StatusCode[error.code], error.message)


    async def _unary(self, context: grpc.aio.ServicerContext, method: str, request: object,
                     signature: pb.TenantSignature, adapter: pb.AdapterRef,
                     base_model: str) -> object:
        principal = await self._principal(context, method)
        try:
            return await on_worker(self.dispatcher, principal, signature, adapter,
                                   base_model or None, method, request,
                                   timeout_s=context.time_remaining() or 30.0)
        except RouteError as error:
            await context.abort(grpc.StatusCode[error.code], error.message)

    async def Tokenize(self, request: pb.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> pb.TokenizeReply:
        return await self._unary(context, "Tokenize", request, request.tenant,  # type: ignore[return-value]
                                 request.adapter, request.base_model)

    async def Detokenize(self, request: pb.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> pb.DetokenizeReply:
        return await self._unary(context, "Detokenize", request, request.tenant,  # type: ignore[return-value]
                                 request.adapter, request.base_model)

    async def ModelInfo(self, request: pb.ModelInfoRequest,
                        context: grpc.aio.ServicerContext) -> pb.ModelInfoReply:
        """The base models and the caller's servable adapters and aliases (`parent`: their
        base model); `model` picks one entry (NOT_FOUND when the caller has no such)."""
        from services.router.openai_http import listed_models

        principal = await self._principal(context, "ModelInfo")
        try:
            tenant = authorize(principal, request.tenant)
        except RouteError as error:
            await context.abort(grpc.StatusCode[error.code], error.message)
        catalog = self.dispatcher.catalog
        entries = model_entries(catalog, tenant, listed_models(catalog, tenant))
        if request.model:
            entries = [e for e in entries if e.id == request.model
                       or (e.parent and e.id.partition(":")[2] == request.model)]
            if not entries:
                await context.abort(grpc.StatusCode.NOT_FOUND,
                                    f"model {request.model[:80]!r} does not exist")
        return pb.ModelInfoReply(models=entries)


class RouterHealth:
    """grpc.health.v1 for the router: NOT_SERVING until the log is replayed."""

    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()

    async def set(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for service in ("", INFERENCE_SERVICE):
            await self.servicer.set(service, status)


def build_server(dispatcher: Dispatcher, tokens: TokenBook, health_: RouterHealth,
                 address: str, settings: Settings | None = None) -> tuple[grpc.aio.Server, int]:
    """The grpc.aio server with every service added and `address` bound; returns its port."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    add_inference_servicer(InferenceServicer(dispatcher, tokens), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_.servicer, server)
    reflection.enable_server_reflection(
        (INFERENCE_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    port = (tls.add_grpc_port(server, address, settings, "router") if settings is not None
            else server.add_insecure_port(address))
    if port == 0:
        raise OSError(f"cannot listen for gRPC on {address}")
    return server, port
