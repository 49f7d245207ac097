"""DecodeService over gRPC: the edge between pdserve.v1 messages and the decode's requests.

Each RPC finds its `DecodeRequest` (AllocateBlocks creates it) and moves it through the lease
table; the servicer keeps a reference to every request whose stream may still be read, and
`kept_requests.KeptRequests` decides how long.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import grpc
import structlog
from opentelemetry import trace

from pdserve.common import telemetry
from pdserve.common.authz import peer_identity
from pdserve.common.errors import ErrorReason, PdserveError, abort_with_error
from pdserve.common.protocol import check_compatible
from pdserve.decode import convert, streams, sync_stream
from pdserve.decode.decode_loop import DecodeLoop
from pdserve.decode.kept_requests import KeptRequests
from pdserve.decode.kv.transfers import (
    TRANSPORT_NAMES,
    WRITTEN_FROM_AFAR,
    WRITTEN_IN_PLACE,
    Transfers,
)
from pdserve.decode.lease_state import RequestStatus
from pdserve.decode.leases import LeaseManager
from pdserve.decode.metrics import DecodeMetrics
from pdserve.decode.request import DecodeRequest
from pdserve.kv.transfer import SYNC_ACCEPTED_KEY
from pdserve.kv.transports.nixl import Progress
from pdserve.kv.transports.offer import TransportOffer
from pdserve.serving.convert import local_protocol
from pdserve.serving.model_host import ModelHost
from pdserve.v1 import decode_pb2, decode_pb2_grpc

log = structlog.get_logger(__name__)

# How long an in-place transfer (shared memory, CUDA IPC) that ended before its commit keeps its
# blocks: a sender's copy of one group of pieces takes milliseconds, and it writes nothing after
# its next message fails; the copies a killed sender had queued on a GPU end with its context.
SHARED_WRITER_GRACE_S = 1.0


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    """Implements pdserve.v1.DecodeService.

    Args:
        host: The loaded model (runner, KV layout).
        leases: The lease table.
        loop: The decode thread.
        metrics: Where transfer durations are observed, if anywhere.
        share_wait_s: How long an allocation with a share key waits for a sibling's KV on its
            way, to share its prompt blocks.
        detached_keep_s, max_detached_requests: How long and how many resumable requests
            are kept without a stream (`KeptRequests`).
    """

    def __init__(
        self,
        host: ModelHost,
        leases: LeaseManager,
        loop: DecodeLoop,
        metrics: DecodeMetrics | None = None,
        share_wait_s: float = 0.0,
        detached_keep_s: float = 60.0,
        max_detached_requests: int = 256,
    ) -> None:
        self.host = host
        self.kept = KeptRequests(loop, detached_keep_s, max_detached_requests)
        self.share_wait_s = share_wait_s
        self.leases = leases
        self.loop = loop
        self.metrics = metrics
        if metrics is not None:
            metrics.count_detached_with(lambda: self.kept.num_detached)
        self.transfers = Transfers(
            host.runner.kv_cache, leases, loop, metrics, host.constraint_compiler()
        )
        self.requests = self.kept.requests  # NOTE: the same dict: RPCs add, `kept` removes
        self.instance_id = ""
        self.transport_offers: tuple[TransportOffer, ...] = ()  # besides gRPC, set by the server
        self.nixl_progress: Progress | None = None  # the NIXL agent's, set by the server

    @property
    def num_kv_bytes_received(self) -> int:
        """KV bytes of committed transfers, every transport."""
        return self.transfers.num_kv_bytes_received

    # ---- AllocateBlocks --------------------------------------------------------------------

    async def AllocateBlocks(
        self, request: decode_pb2.AllocateBlocksRequest, context: grpc.aio.ServicerContext
    ) -> decode_pb2.AllocateBlocksResponse:
        """Grants a lease if the prompt fits beside the running requests' headroom."""
        try:
            check_compatible(request.protocol.version)
            if request.kv_layout.fingerprint != self.host.kv_layout.fingerprint:
                raise PdserveError(
                    ErrorReason.INCOMPATIBLE_PEER,
                    "KV layout fingerprint differs from this decode's",
                    {"requestId": request.request_id, "expected": self.host.kv_layout.fingerprint},
                )
            await self._wait_for_sibling(request.share_key)
            lease = self.leases.allocate(
                request.request_id,
                request.num_prompt_tokens,
                request.max_new_tokens,
                caller=peer_identity(context),
                prefill_instance_id=request.prefill_instance_id,
                share_key=request.share_key,
            )
        except PdserveError as error:
            log.info("lease_refused", request_id=request.request_id, reason=error.reason.name)
            await abort_with_error(context, error)
        self.requests[lease.lease_id] = lease
        trace.get_current_span().set_attributes(
            {telemetry.REQUEST_ID: lease.request_id, "pdserve.lease_id": lease.lease_id,
             "pdserve.num_blocks": len(lease.block_ids)}
        )  # fmt: skip
        log.info(
            "lease_granted",
            request_id=lease.request_id,
            lease_id=lease.lease_id,
            num_blocks=len(lease.block_ids),
            num_shared_blocks=lease.num_shared_blocks,
            num_window_skipped_blocks=lease.num_window_released,
        )
        sliding = self.leases.table.sliding
        return decode_pb2.AllocateBlocksResponse(
            lease=convert.lease_to_proto(
                lease,
                self.leases.table.block_size,
                self.leases.ttl_s,
                self.instance_id,
                self.transport_offers,
                None if sliding is None else sliding.slots,
            ),
            protocol=local_protocol(),
        )

    async def _wait_for_sibling(self, share_key: str) -> None:
        """Waits (at most `share_wait_s`) for the commit of another completion of the same
        prompt whose KV is on its way, so that this one can share its prompt blocks.

        NOTE: the gateway starts a prompt's other completions once the first has its first
        token, which the prefill samples just before it commits the KV: the wait is the tail
        of that one transfer.
        """
        if not share_key or self.share_wait_s <= 0:
            return
        sibling = self.leases.pending_share_source(share_key)
        if sibling is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(sibling.events.ready.wait(), self.share_wait_s)

    # ---- SyncCache -------------------------------------------------------------------------

    async def SyncCache(
        self,
        request_iterator: AsyncIterator[decode_pb2.SyncCacheRequest],
        context: grpc.aio.ServicerContext,
    ) -> decode_pb2.SyncCacheResponse:
        """Receives header, chunks (with their bytes, or naming bytes in shared memory) and
        commit; on any failure frees the lease."""
        lease: DecodeRequest | None = None
        started = time.perf_counter()
        try:
            header = await sync_stream.read_header(request_iterator)
            # NOTE: a refused token leaves the lease as it was (`lease` stays None).
            lease, receiver = self.transfers.begin(header, peer_identity(context))
            trace.get_current_span().set_attributes(
                {telemetry.REQUEST_ID: lease.request_id, "pdserve.lease_id": lease.lease_id,
                 "pdserve.transport": TRANSPORT_NAMES.get(header.transport, "grpc")}
            )  # fmt: skip
            is_shared = header.transport in WRITTEN_IN_PLACE
            commit: decode_pb2.SyncCacheCommit | None = None
            is_end_deferred = False
            # NOTE: a NIXL sender's WRITEs complete only while this agent makes progress:
            # until the blocks are released, late ones included.
            release_progress = (
                self.nixl_progress.hold()
                if header.transport == decode_pb2.TRANSPORT_KIND_NIXL
                and self.nixl_progress is not None
                else _nothing
            )

            def end(lease: DecodeRequest = lease) -> None:
                self.transfers.end(lease)
                release_progress()

            try:
                if is_shared:
                    # NOTE: the sender writes into the segment only after this answer.
                    await context.send_initial_metadata(((SYNC_ACCEPTED_KEY, "1"),))
                commit, checks = await sync_stream.receive_chunks(
                    request_iterator, receiver, header.transport
                )
                for meta, crc in checks:
                    receiver.receive_written(meta, await crc)
                await self.transfers.constraint_compiled(lease)
                response = self.transfers.commit(lease, receiver, header, commit, started)
            except (PdserveError, asyncio.CancelledError, grpc.RpcError) as error:
                is_from_afar = header.transport in WRITTEN_FROM_AFAR
                if (
                    is_shared
                    and commit is None
                    and (is_from_afar or isinstance(error, PdserveError))
                ):
                    # NOTE: the stream ended before the sender's commit: a copy may still be
                    # under way there (it stops at its next write), so the blocks stay held a
                    # little longer. A shared-memory sender that hangs up has stopped writing;
                    # a CUDA IPC sender that died may leave copies queued on the GPU, a NIXL
                    # sender WRITEs on the wire.
                    asyncio.get_running_loop().call_later(SHARED_WRITER_GRACE_S, end)
                    is_end_deferred = True
                raise
            finally:
                if not is_end_deferred:
                    end()
            trace.get_current_span().set_attributes(
                {"pdserve.kv.num_bytes": receiver.num_bytes,
                 "pdserve.kv.num_chunks": receiver.num_chunks}
            )  # fmt: skip
            return response
        except PdserveError as error:
            self.transfers.fail(lease, error)
            await abort_with_error(context, error)
        except (asyncio.CancelledError, grpc.RpcError):
            # NOTE: the sender hung up mid-transfer; the partial cache must never be decoded.
            self.transfers.fail(
                lease,
                PdserveError(
                    ErrorReason.CACHE_SYNC_FAILED, "stream broken", code=grpc.StatusCode.ABORTED
                ),
            )
            raise

    # ---- Generate --------------------------------------------------------------------------

    async def Generate(
        self,
        request: decode_pb2.DecodeServiceGenerateRequest,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[decode_pb2.DecodeServiceGenerateResponse]:
        """Streams a lease's tokens; waits for the commit, bounded by the lease TTL. A
        `resumable` request runs on when its stream breaks (detached), for a `resume` stream
        to attach; `snapshot` reads a request's tokens without attaching."""
        trace.get_current_span().set_attribute(telemetry.REQUEST_ID, request.request_id)
        lease = self.requests.get(request.lease_id)
        epoch: int | None = None
        try:
            if lease is None:
                self.leases.table.get(request.lease_id)  # raises LEASE_NOT_FOUND / LEASE_EXPIRED
                raise PdserveError(ErrorReason.LEASE_NOT_FOUND, "no such lease")
            if request.snapshot:
                messages = streams.snapshot(lease)
            elif request.resume:
                epoch, is_taken_over = await lease.resume()
                log.info(
                    "generate_resumed",
                    request_id=lease.request_id,
                    lease_id=lease.lease_id,
                    num_generated_tokens=max(0, lease.num_generated_tokens),
                    taken_over=is_taken_over,
                )
                messages = streams.resumed(lease, epoch)
            else:
                epoch = await lease.attach(is_resumable=request.resumable)
                messages = streams.live(lease, epoch)
        except PdserveError as error:
            await abort_with_error(context, error)
        is_done = False
        try:
            try:
                async for message in messages:
                    yield message
                is_done = True
            except PdserveError as error:
                is_done = True
                await abort_with_error(context, error)
        finally:
            if epoch is not None:
                self.kept.stream_ended(lease, epoch, is_done)

    # ---- ReleaseLease ----------------------------------------------------------------------

    async def ReleaseLease(
        self, request: decode_pb2.ReleaseLeaseRequest, context: grpc.aio.ServicerContext
    ) -> decode_pb2.ReleaseLeaseResponse:
        """Releases a lease in any state if the caller may (`lease_access`); idempotent."""
        trace.get_current_span().set_attribute(telemetry.REQUEST_ID, request.request_id)
        try:
            lease = self.leases.table.get(request.lease_id)
        except PdserveError:
            status = self.leases.table.ended_status(request.lease_id)
            return decode_pb2.ReleaseLeaseResponse(state=convert.lease_state_to_proto(status))
        try:
            self.leases.check_release(
                lease, request.request_id, request.lease_token, peer_identity(context)
            )
        except PdserveError as error:
            await abort_with_error(context, error)
        self.loop.release(lease, RequestStatus.ABORTED)
        log.info("lease_released", request_id=lease.request_id, lease_id=lease.lease_id)
        return decode_pb2.ReleaseLeaseResponse(state=decode_pb2.LEASE_STATE_ABORTED)

    # ---- upkeep (the server's idle tick) ---------------------------------------------------

    def expire_due(self) -> int:
        """Reclaims leases past their TTL, sweeps `kept`; returns how many expired."""
        expired = self.leases.table.due_for_expiry()
        for lease in expired:
            log.info("lease_expired", request_id=lease.request_id, lease_id=lease.lease_id)
            self.loop.release(lease, RequestStatus.EXPIRED, "lease TTL ran out")
        self.kept.sweep(self.leases.ttl_s)
        return len(expired)


def _nothing() -> None:
    """What ends a transfer's hold on nothing."""
