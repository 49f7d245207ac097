"""The prefill's view of decode instances: cached channels, bounded lease preparation, release.

Preparation is per decode: each decode address has its own `prepare_concurrency` slots, so a
decode that answers slowly (or not at all) only queues the requests aimed at it. Every
preparation has its own deadline (slot wait included); running out of it, or not reaching the
decode, is PEER_UNAVAILABLE; a refusal keeps the decode's own reason (capacity exhausted with
its retry delay, incompatible layout, draining).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
import structlog

from pdserve.common import telemetry
from pdserve.common.errors import ErrorReason, PdserveError, from_rpc_error, has_error_info
from pdserve.common.pki import instance_dns_name, role_dns_name
from pdserve.common.security import Security
from pdserve.prefill import convert
from pdserve.prefill.events import LeaseGrant
from pdserve.prefill.request import Request
from pdserve.serving.convert import local_protocol
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc

log = structlog.get_logger(__name__)

RELEASE_TIMEOUT_S = 5.0
SHARE_RETRY_S = 0.05
# NOTE: a channel whose connection was lost (a link that went down and came back, a decode
# restarted at its address) fails calls at once until it connects again, which its backoff
# (`grpc_server.CHANNEL_OPTIONS`: at most 3 s, jittered by 20%) may put seconds away. An
# allocation that met such a channel asks once more, waiting for it to connect for at most
# this long (and never past its own deadline).
RECONNECT_WAIT_S = 4.0
PEER_SHARE_LIMIT = "peer_share"  # NOTE: the decode's ErrorInfo ``limit`` for its share rule
_TRANSPORT_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


@dataclass
class _Peer:
    channel: grpc.aio.Channel
    stub: decode_pb2_grpc.DecodeServiceStub
    slots: asyncio.Semaphore


def peer_error(error: grpc.RpcError, address: str, what: str) -> PdserveError:
    """The typed error for a failed call to a decode: its own reason when it sent one,
    PEER_UNAVAILABLE when it could not be reached or did not answer in time."""
    typed = from_rpc_error(error)
    code = _code(error)
    if code in _TRANSPORT_CODES and typed.reason in (
        ErrorReason.PEER_UNAVAILABLE,
        ErrorReason.DEADLINE_EXCEEDED,
    ):
        # NOTE: the transport's own words (``failed to connect to all addresses ...``) are for
        # the log; the error a client may see says what was unreachable and when.
        log.info("decode_unreachable", address=address, call=what, detail=typed.message)
        did = (
            "did not answer in time"
            if code is grpc.StatusCode.DEADLINE_EXCEEDED
            else "was unreachable"
        )
        return PdserveError(
            ErrorReason.PEER_UNAVAILABLE,
            f"decode {address} {did} during {what}",
            {"decodeAddress": address},
        )
    typed.metadata.setdefault("decodeAddress", address)
    return typed


def is_connection_lost(error: grpc.RpcError) -> bool:
    """`error` is the channel's, not the decode's: UNAVAILABLE with no reason of a decode's
    own (a decode that refuses while draining says so)."""
    return _code(error) is grpc.StatusCode.UNAVAILABLE and not has_error_info(error)


def _code(error: grpc.RpcError) -> grpc.StatusCode | None:
    return error.code() if isinstance(error, grpc.aio.AioRpcError) else None


def _is_connected(channel: grpc.aio.Channel) -> bool:
    return channel.get_state(try_to_connect=False) is grpc.ChannelConnectivity.READY


@dataclass(eq=False)
class DecodePeers:
    """Channels to the decodes this prefill ships to, one per address, opened on first use.

    Args:
        instance_id: This prefill's instance id (sent with every allocation).
        kv_layout: This prefill's KvLayout (the decode checks its fingerprint).
        prepare_concurrency: AllocateBlocks calls in flight per decode.
        allocate_timeout_s: Deadline of one preparation, slot wait included.
        security: How to dial decodes. With mTLS a channel to a named decode instance only
            connects if the server's certificate is that instance's, so KV goes to no one else.
    """

    instance_id: str
    kv_layout: common_pb2.KvLayout
    prepare_concurrency: int
    allocate_timeout_s: float
    security: Security = field(default_factory=Security.insecure)
    _protocol: common_pb2.Protocol = field(default_factory=local_protocol, init=False, repr=False)
    _peers: dict[tuple[str, str], _Peer] = field(default_factory=dict, init=False, repr=False)

    def _peer(self, address: str, instance_id: str = "") -> _Peer:
        peer = self._peers.get((address, instance_id))
        if peer is None:
            name = (
                instance_dns_name("decode", instance_id) if instance_id else role_dns_name("decode")
            )
            channel = self.security.channel(address, name)
            peer = _Peer(
                channel,
                decode_pb2_grpc.DecodeServiceStub(channel),
                asyncio.Semaphore(self.prepare_concurrency),
            )
            self._peers[(address, instance_id)] = peer
        return peer

    def stub(self, address: str, instance_id: str = "") -> decode_pb2_grpc.DecodeServiceStub:
        """The DecodeService stub for decode `instance_id` at `address` (channel cached); any
        decode of the cluster when `instance_id` is empty."""
        return self._peer(address, instance_id).stub

    async def allocate(self, request: Request) -> LeaseGrant:
        """Leases blocks for `request` on its target decode.

        A refusal for this prefill's share of the decode's pool is waited out (asking again
        after the decode's retry delay) until the deadline. A decode that could not be reached
        is asked once more, the call waiting for the channel to connect again (at most
        `RECONNECT_WAIT_S`): a connection lost a moment ago (a link down and up again) costs a
        request a short wait, not its attempt. A decode that received the first call and
        granted a lease whose answer was lost keeps that lease until its TTL.

        Raises:
            PdserveError: PEER_UNAVAILABLE when the decode is unreachable or too slow; the
                decode's reason when it refused.
        """
        address = request.decode_address
        peer = self._peer(address, request.decode_instance_id)
        message = convert.allocate_request(
            request, self.kv_layout, self._protocol, self.instance_id
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.allocate_timeout_s
        lost: grpc.RpcError | None = None  # the call the channel failed at once, if one was
        while True:
            try:
                async with asyncio.timeout_at(deadline), peer.slots:
                    remaining = max(0.001, deadline - loop.time())
                    if lost is not None:
                        remaining = min(remaining, RECONNECT_WAIT_S)
                    response = await peer.stub.AllocateBlocks(
                        message,
                        timeout=remaining,
                        metadata=telemetry.outgoing_metadata(),
                        wait_for_ready=lost is not None,
                    )
                return convert.lease_from_proto(response.lease)
            except TimeoutError:
                raise PdserveError(
                    ErrorReason.PEER_UNAVAILABLE,
                    f"decode {address} granted no lease within {self.allocate_timeout_s:.3g}s",
                    {"decodeAddress": address, "requestId": request.request_id},
                ) from None
            except grpc.RpcError as error:
                if lost is None and is_connection_lost(error):
                    log.info(
                        "decode_reconnecting",
                        address=address,
                        request_id=request.request_id,
                        detail=from_rpc_error(error).message,
                    )
                    lost = error
                    continue
                if (
                    lost is not None
                    and _code(error) is grpc.StatusCode.DEADLINE_EXCEEDED
                    and not _is_connected(peer.channel)
                ):
                    error = lost  # NOTE: never connected again: unreachable, not slow
                refusal = peer_error(error, address, "AllocateBlocks")
            # NOTE: over our share of the decode's pool: our own leases commit soon, so wait
            # (bounded by the deadline) rather than fail the request.
            delay_s = refusal.retry_delay_s or SHARE_RETRY_S
            if refusal.metadata.get("limit") != PEER_SHARE_LIMIT or (
                loop.time() + delay_s >= deadline
            ):
                raise refusal
            await asyncio.sleep(delay_s)

    async def release_lease(self, address: str, lease: LeaseGrant, request_id: str) -> bool:
        """Releases a lease, presenting its token (idempotent on the decode); False if the
        decode could not be told.

        A lease the decode never hears about is reclaimed by its TTL.
        """
        lease_id = lease.lease_id
        request = decode_pb2.ReleaseLeaseRequest(
            lease_id=lease_id, request_id=request_id, lease_token=lease.transport_token
        )
        try:
            # NOTE: the current context is the request's: the release joins its trace. The
            # lease's decode is the one the allocation reached: the same channel.
            await self._peer(address, lease.decode_instance_id).stub.ReleaseLease(
                request, timeout=RELEASE_TIMEOUT_S, metadata=telemetry.outgoing_metadata()
            )
        except grpc.RpcError as error:
            log.warning(
                "lease_release_failed",
                request_id=request_id,
                lease_id=lease_id,
                decode_address=address,
                reason=from_rpc_error(error).reason.name,
            )
            return False
        log.info("lease_released", request_id=request_id, lease_id=lease_id)
        return True

    async def close(self) -> None:
        """Closes every channel."""
        peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            await peer.channel.close()
