"""KvSender's error classification when the decode ends a SyncCache stream early."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import SamplingParams
from pdserve.prefill.events import LeaseGrant
from pdserve.prefill.kv.channels import GrpcChannel
from pdserve.prefill.kv.sender import KvSender
from pdserve.prefill.request import Request
from pdserve.v1 import decode_pb2


class _EndedCall:
    """A SyncCache call the decode already ended: writes fail, awaiting gives `status`."""

    def __init__(self, status: grpc.aio.AioRpcError) -> None:
        self.status = status

    async def write(self, message: decode_pb2.SyncCacheRequest) -> None:
        raise self.status

    def cancel(self) -> bool:
        return True

    def __await__(self) -> Any:
        raise self.status
        yield  # pragma: no cover - makes this a generator


class _Stub:
    def __init__(self, status: grpc.aio.AioRpcError, lease_state: int | None) -> None:
        self.call = _EndedCall(status)
        self.lease_state = lease_state
        self.released: list[tuple[str, str, bytes]] = []

    def SyncCache(self, metadata: Any = None) -> _EndedCall:
        return self.call

    async def ReleaseLease(
        self, request: decode_pb2.ReleaseLeaseRequest, timeout: float
    ) -> decode_pb2.ReleaseLeaseResponse:
        self.released.append((request.lease_id, request.request_id, request.lease_token))
        if self.lease_state is None:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone"
            )
        return decode_pb2.ReleaseLeaseResponse(state=self.lease_state)


def _request() -> Request:
    request = Request(
        request_id="r1",
        token_ids=[1, 2, 3],
        num_prompt_tokens=3,
        sampling=SamplingParams(max_tokens=4),
        seed=0,
        decode_address="127.0.0.1:1",
    )
    request.lease = LeaseGrant(
        lease_id="lease-1", block_ids=(0,), decode_instance_id="d", transport_token=b"t0k3n"
    )
    return request


def _sender(stub: _Stub) -> KvSender:
    request = _request()
    return KvSender(request, [GrpcChannel(stub, request)])  # type: ignore[arg-type]


def _status(error: PdserveError | None) -> grpc.aio.AioRpcError:
    """A failed call's error: the decode's typed status, or grpc.aio's local INTERNAL one."""
    if error is None:
        return grpc.aio.AioRpcError(
            grpc.StatusCode.INTERNAL,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(),
            "Internal error from Core",
        )
    status = error.to_status()
    return grpc.aio.AioRpcError(
        status.code,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(*status.trailing_metadata),
        status.details,
    )


@pytest.mark.parametrize(
    ("lease_state", "reason"),
    [
        (decode_pb2.LEASE_STATE_FAILED, ErrorReason.CACHE_SYNC_FAILED),
        (decode_pb2.LEASE_STATE_EXPIRED, ErrorReason.LEASE_EXPIRED),
        (None, ErrorReason.PEER_UNAVAILABLE),
    ],
)
async def test_a_status_lost_to_a_failed_write_is_recovered_from_the_lease(
    lease_state: int | None, reason: ErrorReason
) -> None:
    stub = _Stub(_status(None), lease_state)
    with pytest.raises(PdserveError) as raised:
        await _sender(stub).run()
    assert raised.value.reason is reason
    assert stub.released == [("lease-1", "r1", b"t0k3n")]  # the lease's own token


async def test_the_decodes_own_status_is_kept() -> None:
    refused = PdserveError(
        ErrorReason.CACHE_SYNC_FAILED, "bad checksum", code=grpc.StatusCode.DATA_LOSS
    )
    stub = _Stub(_status(refused), decode_pb2.LEASE_STATE_FAILED)
    with pytest.raises(PdserveError) as raised:
        await _sender(stub).run()
    assert raised.value.reason is ErrorReason.CACHE_SYNC_FAILED
    assert raised.value.code is grpc.StatusCode.DATA_LOSS
    assert raised.value.metadata["decodeAddress"] == "127.0.0.1:1"
    assert stub.released == []  # no need to ask
