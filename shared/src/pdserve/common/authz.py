"""Who may call what on the internal plane: one table, enforced by one server interceptor.

Mutual TLS proves a caller's certificate comes from the cluster CA; `CALLERS` then says which
roles may call each RPC. A method missing from the table is refused (so a new RPC cannot
slip through unguarded), and the contract test walks every RPC of every service against it.
Servicers that must also know *which* instance called (the registry binds instance ids,
leases remember their prefill) read it with `peer_identity(context)`.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpc

from pdserve.common.errors import ErrorReason, PdserveError, abort_with_error
from pdserve.common.pki import Identity, identity_from_spiffe_id

GATEWAY, PREFILL, DECODE, CLIENT = "gateway", "prefill", "decode", "client"
ANY_ROLE = frozenset({GATEWAY, PREFILL, DECODE, CLIENT})

CALLERS: Mapping[str, frozenset[str]] = {
    # Prefill: only a gateway starts or aborts work; status for gateways and operators.
    "/pdserve.v1.PrefillService/Prefill": frozenset({GATEWAY}),
    "/pdserve.v1.PrefillService/AbortRequest": frozenset({GATEWAY}),
    "/pdserve.v1.PrefillService/GetModelInfo": frozenset({GATEWAY, CLIENT}),
    # Decode: prefills lease blocks and write KV; the gateway streams tokens and cleans up.
    "/pdserve.v1.DecodeService/AllocateBlocks": frozenset({PREFILL}),
    "/pdserve.v1.DecodeService/SyncCache": frozenset({PREFILL}),
    "/pdserve.v1.DecodeService/Generate": frozenset({GATEWAY}),
    "/pdserve.v1.DecodeService/ReleaseLease": frozenset({PREFILL, GATEWAY}),
    "/pdserve.v1.InstanceService/GetInstanceStatus": frozenset({GATEWAY, CLIENT}),
    # Gateway's internal port: only instances register (as themselves: see the registry).
    "/pdserve.v1.RegistryService/Register": frozenset({PREFILL, DECODE}),
    "/pdserve.v1.RegistryService/Heartbeat": frozenset({PREFILL, DECODE}),
    "/pdserve.v1.RegistryService/Deregister": frozenset({PREFILL, DECODE}),
    # Standard services: any member of the cluster.
    "/grpc.health.v1.Health/Check": ANY_ROLE,
    "/grpc.health.v1.Health/Watch": ANY_ROLE,
    "/grpc.health.v1.Health/List": ANY_ROLE,
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": ANY_ROLE,
}


def peer_identity(context: grpc.aio.ServicerContext) -> Identity | None:
    """The calling service's identity from its mTLS certificate, or None (plaintext)."""
    auth = context.auth_context()
    for spiffe_id in auth.get("peer_spiffe_id", ()):
        identity = identity_from_spiffe_id(spiffe_id.decode())
        if identity is not None:
            return identity
    return None


def denied(method: str, identity: Identity | None) -> PdserveError:
    """The PERMISSION_DENIED error for `identity` calling `method`."""
    who = "a caller without a pdserve identity" if identity is None else f"{identity}"
    allowed = sorted(CALLERS.get(method, ()))
    return PdserveError(
        ErrorReason.PERMISSION_DENIED,
        f"{who} may not call {method}"
        + (f" (allowed roles: {', '.join(allowed)})" if allowed else " (not on this plane)"),
        {"method": method},
    )


class AuthorizationInterceptor(grpc.aio.ServerInterceptor):
    """Refuses any call whose caller's role is not in `callers[method]` (PERMISSION_DENIED).

    Install it only on an mTLS server: every caller there has a verified certificate.

    Args:
        callers: Method to roles allowed; methods missing from it are refused.
    """

    def __init__(self, callers: Mapping[str, frozenset[str]] = CALLERS) -> None:
        self._callers = callers

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        return _guarded(handler, method, self._callers.get(method, frozenset()))


def _guarded(
    handler: grpc.RpcMethodHandler, method: str, roles: frozenset[str]
) -> grpc.RpcMethodHandler:
    """`handler` with a role check before its behaviour runs (same streaming shape)."""

    async def check(context: grpc.aio.ServicerContext) -> None:
        identity = peer_identity(context)
        if identity is None or identity.role not in roles:
            await abort_with_error(context, denied(method, identity))

    def wrap(behaviour: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behaviour):

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await check(context)
                async for response in behaviour(request, context):
                    yield response

            return stream

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await check(context)
            return await behaviour(request, context)

        return call

    kinds = (
        ("unary_unary", grpc.unary_unary_rpc_method_handler),
        ("unary_stream", grpc.unary_stream_rpc_method_handler),
        ("stream_unary", grpc.stream_unary_rpc_method_handler),
        ("stream_stream", grpc.stream_stream_rpc_method_handler),
    )
    for attribute, make in kinds:
        behaviour = getattr(handler, attribute)
        if behaviour is not None:
            return make(
                wrap(behaviour),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    return handler
