"""gRPC clients of prefill and decode instances, behind the plain `Backend` interface.

One channel per address, reused by every request. Every `grpc.aio.AioRpcError` becomes a
`BackendError` carrying the typed `PdserveError` (classified by its ErrorInfo reason, or by
the status code when the status carries none). With tracing on, each request-path call
(Prefill, Generate, AbortRequest, ReleaseLease) is a CLIENT span; status, health and
model-info calls are not traced.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.context import Context

from pdserve.common import telemetry
from pdserve.common.errors import from_rpc_error, has_error_info
from pdserve.common.pki import MEMBER_DNS_NAME, role_dns_name
from pdserve.common.security import Security
from pdserve.gateway.fleet import convert
from pdserve.gateway.fleet.backend import (
    BackendError,
    DecodeCall,
    DecodeEvent,
    DecodeSnapshot,
    FinishedEvent,
    PreemptionEvent,
    PrefillCall,
    PrefillEvent,
    TokenBatchEvent,
)
from pdserve.gateway.fleet.instance import InstanceInfo, LoadReport
from pdserve.gateway.fleet.model_info import ModelFiles
from pdserve.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    instance_pb2,
    instance_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)

# NOTE: statuses a call ends with when its connection breaks (server gone, connection reset,
# server shut down mid-stream) rather than because the server's code decided to fail it.
_CONNECTION_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)

PREFILL = "/pdserve.v1.PrefillService/Prefill"
ABORT_REQUEST = "/pdserve.v1.PrefillService/AbortRequest"
GENERATE = "/pdserve.v1.DecodeService/Generate"
RELEASE_LEASE = "/pdserve.v1.DecodeService/ReleaseLease"

E = TypeVar("E")


def backend_error(error: grpc.RpcError) -> BackendError:
    """Wraps a failed call's status as a `BackendError`.

    A status with a pdserve.v1 ErrorInfo, or any code other than UNAVAILABLE / CANCELLED (an
    unhandled exception in a servicer arrives as UNKNOWN), counts as reported by the server;
    a bare UNAVAILABLE or CANCELLED means the connection to the instance was lost.
    """
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    is_from_server = has_error_info(error) or code not in _CONNECTION_CODES
    return BackendError(from_rpc_error(error), is_from_server=is_from_server)


PREFILL_NAME = role_dns_name("prefill")
DECODE_NAME = role_dns_name("decode")


class GrpcBackend:
    """`Backend` over gRPC, plus the status, health and model-info calls the gateway makes.

    Args:
        security: How to dial instances; with mTLS a prefill call only connects to a server
            with a prefill certificate of the cluster CA, a decode call to a decode's.
    """

    def __init__(self, security: Security | None = None) -> None:
        self.security = security or Security.insecure()
        self._channels: dict[tuple[str, str], grpc.aio.Channel] = {}

    def channel(self, address: str, server_name: str = MEMBER_DNS_NAME) -> grpc.aio.Channel:
        """The shared channel to `address` whose server must present `server_name` (created
        on first use)."""
        channel = self._channels.get((address, server_name))
        if channel is None:
            channel = self.security.channel(address, server_name)
            self._channels[(address, server_name)] = channel
        return channel

    async def close(self) -> None:
        """Closes every channel."""
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()

    def prefill(
        self, address: str, call: PrefillCall, timeout_s: float
    ) -> AsyncGenerator[PrefillEvent, None]:
        """Streams one Prefill RPC's events; closing the iterator cancels the call."""
        stub = prefill_pb2_grpc.PrefillServiceStub(self.channel(address, PREFILL_NAME))
        request = convert.prefill_request_to_pb(call)
        return _server_stream(
            PREFILL,
            address,
            call.request_id,
            call.trace_context,
            lambda metadata: stub.Prefill(request, timeout=timeout_s, metadata=metadata),
            convert.prefill_event_from_pb,
        )

    async def abort_request(
        self,
        address: str,
        request_id: str,
        timeout_s: float,
        trace_context: Context | None = None,
    ) -> None:
        """PrefillService.AbortRequest."""
        stub = prefill_pb2_grpc.PrefillServiceStub(self.channel(address, PREFILL_NAME))
        request = prefill_pb2.AbortRequestRequest(request_id=request_id)
        await _unary(
            ABORT_REQUEST,
            address,
            request_id,
            trace_context,
            lambda metadata: stub.AbortRequest(request, timeout=timeout_s, metadata=metadata),
        )

    def generate(
        self, address: str, call: DecodeCall, timeout_s: float
    ) -> AsyncGenerator[DecodeEvent, None]:
        """Streams DecodeService.Generate's events; closing the iterator cancels the call."""
        stub = decode_pb2_grpc.DecodeServiceStub(self.channel(address, DECODE_NAME))
        request = decode_pb2.DecodeServiceGenerateRequest(
            request_id=call.request_id,
            lease_id=call.lease_id,
            resumable=call.resumable,
            resume=call.resume,
        )
        return _server_stream(
            GENERATE,
            address,
            call.request_id,
            call.trace_context,
            lambda metadata: stub.Generate(request, timeout=timeout_s, metadata=metadata),
            convert.decode_event_from_pb,
        )

    async def snapshot(
        self, address: str, request_id: str, lease_id: str, timeout_s: float
    ) -> DecodeSnapshot:
        """DecodeService.Generate with `snapshot`: the tokens so far and the end, if any."""
        stub = decode_pb2_grpc.DecodeServiceStub(self.channel(address, DECODE_NAME))
        request = decode_pb2.DecodeServiceGenerateRequest(
            request_id=request_id, lease_id=lease_id, snapshot=True
        )
        token_ids: list[int] = []
        end: FinishedEvent | PreemptionEvent | None = None
        try:
            async for message in stub.Generate(request, timeout=timeout_s):
                event = convert.decode_event_from_pb(message)
                if isinstance(event, TokenBatchEvent):
                    token_ids.extend(event.token_ids)
                elif event is not None:
                    end = event
        except grpc.aio.AioRpcError as error:
            raise backend_error(error) from error
        return DecodeSnapshot(tuple(token_ids), end)

    async def release_lease(
        self,
        address: str,
        lease_id: str,
        request_id: str,
        timeout_s: float,
        trace_context: Context | None = None,
    ) -> None:
        """DecodeService.ReleaseLease."""
        stub = decode_pb2_grpc.DecodeServiceStub(self.channel(address, DECODE_NAME))
        request = decode_pb2.ReleaseLeaseRequest(lease_id=lease_id, request_id=request_id)
        await _unary(
            RELEASE_LEASE,
            address,
            request_id,
            trace_context,
            lambda metadata: stub.ReleaseLease(request, timeout=timeout_s, metadata=metadata),
        )

    async def get_model_files(self, address: str, timeout_s: float = 10.0) -> ModelFiles:
        """PrefillService.GetModelInfo."""
        stub = prefill_pb2_grpc.PrefillServiceStub(self.channel(address, PREFILL_NAME))
        try:
            response = await stub.GetModelInfo(prefill_pb2.GetModelInfoRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as error:
            raise backend_error(error) from error
        return convert.model_files_from_pb(response)

    async def get_instance_status(
        self, address: str, timeout_s: float
    ) -> tuple[InstanceInfo, LoadReport]:
        """InstanceService.GetInstanceStatus (counts only, no integrity pass)."""
        stub = instance_pb2_grpc.InstanceServiceStub(self.channel(address))
        try:
            response = await stub.GetInstanceStatus(
                instance_pb2.GetInstanceStatusRequest(), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as error:
            raise backend_error(error) from error
        return convert.instance_status_from_pb(response)

    async def is_serving(self, address: str, timeout_s: float) -> bool:
        """Whether grpc.health.v1 reports the server SERVING (False on any failure)."""
        stub = health_pb2_grpc.HealthStub(self.channel(address))
        try:
            response = await stub.Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
            )
        except grpc.aio.AioRpcError:
            return False
        return response.status == health_pb2.HealthCheckResponse.SERVING


async def _unary(
    span_name: str,
    address: str,
    request_id: str,
    trace_context: Context | None,
    call: Callable[[Any], Awaitable[Any]],
) -> None:
    """Makes a request-path unary call, `call(metadata)`, under a CLIENT span; a failed call
    raises `BackendError`."""
    try:
        with telemetry.client_span(span_name, address, request_id, trace_context) as traced:
            await call(traced.metadata)
    except grpc.aio.AioRpcError as error:
        raise backend_error(error) from error


async def _server_stream(
    span_name: str,
    address: str,
    request_id: str,
    trace_context: Context | None,
    start: Callable[[Any], Any],
    from_pb: Callable[[Any], E | None],
) -> AsyncGenerator[E, None]:
    """Yields a server stream's messages as events (None skipped) under a CLIENT span.

    `start(metadata)` opens the call; leaving the iterator cancels it, and a failed call
    raises `BackendError`.
    """
    try:
        with telemetry.client_span(span_name, address, request_id, trace_context) as traced:
            rpc = start(traced.metadata)
            try:
                async for message in rpc:
                    event = from_pb(message)
                    if event is not None:
                        yield event
            finally:
                rpc.cancel()
    except grpc.aio.AioRpcError as error:
        raise backend_error(error) from error
