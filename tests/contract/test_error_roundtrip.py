"""Every ErrorReason crosses a real grpc.aio server and comes back typed and classified."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from pdserve.common import errors
from pdserve.common.errors import ErrorReason, PdserveError, RetryScope
from pdserve.common.grpc_server import add_standard_services, new_aio_server
from pdserve.common.protocol import check_compatible
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

S = grpc.StatusCode
# The DESIGN.md section 3 table, written out independently of errors.REASON_SPECS.
DESIGN_TABLE: dict[str, tuple[grpc.StatusCode, RetryScope]] = {
    "INVALID_REQUEST": (S.INVALID_ARGUMENT, RetryScope.NEVER),
    "PROMPT_TOO_LONG": (S.INVALID_ARGUMENT, RetryScope.NEVER),
    "INCOMPATIBLE_PEER": (S.FAILED_PRECONDITION, RetryScope.ANOTHER_PAIR),
    "DECODE_CAPACITY_EXHAUSTED": (S.RESOURCE_EXHAUSTED, RetryScope.ANOTHER_DECODE),
    "PREFILL_OVERLOADED": (S.RESOURCE_EXHAUSTED, RetryScope.ANOTHER_PREFILL),
    "LEASE_EXPIRED": (S.NOT_FOUND, RetryScope.WHOLE_REQUEST),
    "LEASE_NOT_FOUND": (S.NOT_FOUND, RetryScope.WHOLE_REQUEST),
    "CACHE_SYNC_FAILED": (S.DATA_LOSS, RetryScope.WHOLE_REQUEST),
    "PREEMPTED": (S.ABORTED, RetryScope.RESCHEDULE),
    "INSTANCE_DRAINING": (S.UNAVAILABLE, RetryScope.ANOTHER_INSTANCE),
    "PEER_UNAVAILABLE": (S.UNAVAILABLE, RetryScope.ANOTHER_INSTANCE),
    "CANCELLED": (S.CANCELLED, RetryScope.NEVER),
    "DEADLINE_EXCEEDED": (S.DEADLINE_EXCEEDED, RetryScope.NEVER),
    "INTERNAL": (S.INTERNAL, RetryScope.ONCE),
    # Additions beyond the DESIGN table (documented in docs/architecture.md).
    "UNAUTHENTICATED": (S.UNAUTHENTICATED, RetryScope.NEVER),
    "MODEL_NOT_FOUND": (S.NOT_FOUND, RetryScope.NEVER),
    "INSTANCE_NOT_REGISTERED": (S.NOT_FOUND, RetryScope.REGISTER_AGAIN),
    "NO_HEALTHY_INSTANCES": (S.UNAVAILABLE, RetryScope.ANOTHER_INSTANCE),
    "REQUEST_TOO_LARGE": (S.RESOURCE_EXHAUSTED, RetryScope.NEVER),
    "RATE_LIMITED": (S.RESOURCE_EXHAUSTED, RetryScope.WHOLE_REQUEST),
    "PERMISSION_DENIED": (S.PERMISSION_DENIED, RetryScope.NEVER),
    "REQUEST_NOT_FOUND": (S.NOT_FOUND, RetryScope.NEVER),
}
RETRY_DELAY_S = 0.25


class _FailingPrefill(prefill_pb2_grpc.PrefillServiceServicer):
    """AbortRequest fails with the reason named by request_id; Prefill fails mid-stream."""

    async def AbortRequest(
        self, request: prefill_pb2.AbortRequestRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.AbortRequestResponse:
        reason = ErrorReason[request.request_id]
        await errors.abort_with_error(
            context,
            PdserveError(
                reason,
                f"injected {reason.name}",
                {"requestId": request.request_id, "leaseId": "lease-7"},
                retry_delay_s=RETRY_DELAY_S,
            ),
        )

    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[prefill_pb2.PrefillResponse]:
        yield prefill_pb2.PrefillResponse(first_token=prefill_pb2.FirstToken(token_id=5))
        await errors.abort_with_error(
            context, PdserveError(ErrorReason.CACHE_SYNC_FAILED, "stream cut", code=S.ABORTED)
        )


class _VersionCheckingDecode(decode_pb2_grpc.DecodeServiceServicer):
    async def AllocateBlocks(
        self, request: decode_pb2.AllocateBlocksRequest, context: grpc.aio.ServicerContext
    ) -> decode_pb2.AllocateBlocksResponse:
        try:
            check_compatible(request.protocol.version)
        except PdserveError as error:
            await errors.abort_with_error(context, error)
        return decode_pb2.AllocateBlocksResponse(lease=decode_pb2.Lease(lease_id="lease-1"))


@pytest.fixture
async def channel() -> AsyncIterator[grpc.aio.Channel]:
    server = new_aio_server()
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(_FailingPrefill(), server)
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(_VersionCheckingDecode(), server)
    await add_standard_services(server, ["pdserve.v1.PrefillService", "pdserve.v1.DecodeService"])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        yield ch
    await server.stop(grace=None)


def test_design_table_covers_every_reason() -> None:
    assert set(DESIGN_TABLE) == {reason.name for reason in ErrorReason}


@pytest.mark.parametrize("reason_name", sorted(DESIGN_TABLE))
async def test_reason_round_trips(channel: grpc.aio.Channel, reason_name: str) -> None:
    stub = prefill_pb2_grpc.PrefillServiceStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.AbortRequest(prefill_pb2.AbortRequestRequest(request_id=reason_name))
    expected_code, expected_scope = DESIGN_TABLE[reason_name]
    assert caught.value.code() == expected_code

    error = errors.from_rpc_error(caught.value)
    assert error.reason is ErrorReason[reason_name]
    assert error.code == expected_code
    assert error.retry_scope is expected_scope
    assert error.is_retryable == (expected_scope is not RetryScope.NEVER)
    assert error.metadata == {"requestId": reason_name, "leaseId": "lease-7"}
    assert error.retry_delay_s == pytest.approx(RETRY_DELAY_S)
    assert error.message == f"injected {reason_name}"


async def test_error_after_stream_messages_keeps_reason_and_code(
    channel: grpc.aio.Channel,
) -> None:
    stub = prefill_pb2_grpc.PrefillServiceStub(channel)
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for event in stub.Prefill(prefill_pb2.PrefillRequest(request_id="r1")):
            received.append(event.first_token.token_id)
    assert received == [5]
    error = errors.from_rpc_error(caught.value)
    assert (error.reason, error.code) == (ErrorReason.CACHE_SYNC_FAILED, S.ABORTED)
    assert error.retry_delay_s is None


async def test_status_without_error_info_maps_by_code() -> None:
    # A server that is not listening at all: the transport fails, no ErrorInfo exists.
    async with grpc.aio.insecure_channel("127.0.0.1:1") as ch:
        stub = prefill_pb2_grpc.PrefillServiceStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.AbortRequest(prefill_pb2.AbortRequestRequest(request_id="x"), timeout=5)
    error = errors.from_rpc_error(caught.value)
    assert error.reason is ErrorReason.PEER_UNAVAILABLE
    assert error.retry_scope is RetryScope.ANOTHER_INSTANCE


@pytest.mark.parametrize("version", ["1.0", "1.7", "1.12"])
async def test_same_major_any_minor_is_accepted(channel: grpc.aio.Channel, version: str) -> None:
    stub = decode_pb2_grpc.DecodeServiceStub(channel)
    request = decode_pb2.AllocateBlocksRequest(protocol=common_pb2.Protocol(version=version))
    response = await stub.AllocateBlocks(request)
    assert response.lease.lease_id == "lease-1"


@pytest.mark.parametrize("version", ["2.0", "0.9", "", "1", "v1.0", "1.0.0"])
async def test_other_major_or_malformed_is_refused(channel: grpc.aio.Channel, version: str) -> None:
    stub = decode_pb2_grpc.DecodeServiceStub(channel)
    request = decode_pb2.AllocateBlocksRequest(protocol=common_pb2.Protocol(version=version))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.AllocateBlocks(request)
    error = errors.from_rpc_error(caught.value)
    assert error.reason is ErrorReason.INCOMPATIBLE_PEER
    assert caught.value.code() == S.FAILED_PRECONDITION
    assert error.retry_scope is RetryScope.ANOTHER_PAIR
