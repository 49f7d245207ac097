"""DecodeService over gRPC: the edge between pdserve.v1 messages and the lease table and loop."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import structlog
from opentelemetry import trace

from pdserve.common import telemetry
from pdserve.common.errors import ErrorReason, PdserveError, abort_with_error
from pdserve.common.generation import resolve_seed
from pdserve.common.protocol import check_compatible
from pdserve.decode import convert
from pdserve.decode.decode_loop import DecodeEvent, DecodeLoop, DecodeRequest, EndedEvent
from pdserve.decode.kv_receiver import KvChunkData, KvReceiver
from pdserve.decode.leases import Lease, LeaseManager, LeaseState
from pdserve.decode.metrics import DecodeMetrics
from pdserve.serving.convert import local_protocol, sampling_from_proto
from pdserve.serving.model_host import ModelHost
from pdserve.v1 import decode_pb2, decode_pb2_grpc

log = structlog.get_logger(__name__)
_tracer = telemetry.tracer("pdserve.decode")


@dataclass(eq=False)
class LeaseStream:
    """Event-loop side of one lease: where its decode events wait for a Generate stream."""

    lease: Lease
    queue: asyncio.Queue[DecodeEvent] = field(default_factory=asyncio.Queue)
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # committed or ended
    is_attached: bool = False
    ended_at: float | None = None


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    """Implements pdserve.v1.DecodeService.

    Args:
        host: The loaded model (runner, KV layout).
        leases: The lease table.
        loop: The decode thread.
        metrics: Where transfer durations are observed, if anywhere.
    """

    def __init__(
        self,
        host: ModelHost,
        leases: LeaseManager,
        loop: DecodeLoop,
        metrics: DecodeMetrics | None = None,
    ) -> None:
        self.host = host
        self.leases = leases
        self.loop = loop
        self.metrics = metrics
        self.num_kv_bytes_received = 0
        self.streams: dict[str, LeaseStream] = {}
        self.instance_id = ""

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
            lease = self.leases.allocate(
                request.request_id, request.num_prompt_tokens, request.max_new_tokens
            )
        except PdserveError as error:
            log.info("lease_refused", request_id=request.request_id, reason=error.reason.name)
            await abort_with_error(context, error)
        self.streams[lease.lease_id] = LeaseStream(lease)
        trace.get_current_span().set_attributes(
            {telemetry.REQUEST_ID: lease.request_id, "pdserve.lease_id": lease.lease_id,
             "pdserve.num_blocks": len(lease.block_ids)}
        )  # fmt: skip
        log.info(
            "lease_granted",
            request_id=lease.request_id,
            lease_id=lease.lease_id,
            num_blocks=len(lease.block_ids),
        )
        ttl_ms = round(self.leases.ttl_s * 1000)
        return decode_pb2.AllocateBlocksResponse(
            lease=decode_pb2.Lease(
                lease_id=lease.lease_id,
                block_ids=lease.block_ids,
                block_size=self.leases.block_size,
                expires_at_unix_ms=int(time.time() * 1000) + ttl_ms,
                ttl_ms=ttl_ms,
                transports=[
                    decode_pb2.Transport(
                        kind=decode_pb2.TRANSPORT_KIND_GRPC_SYNC_CACHE,
                        token=secrets.token_bytes(16),
                    )
                ],
                decode_instance_id=self.instance_id,
            ),
            protocol=local_protocol(),
        )

    # ---- SyncCache -------------------------------------------------------------------------

    async def SyncCache(
        self,
        request_iterator: AsyncIterator[decode_pb2.SyncCacheRequest],
        context: grpc.aio.ServicerContext,
    ) -> decode_pb2.SyncCacheResponse:
        """Receives header, chunks and commit; on any failure frees the lease."""
        lease: Lease | None = None
        started = time.perf_counter()
        try:
            lease, receiver, header = await self._open_transfer(request_iterator)
            trace.get_current_span().set_attribute(telemetry.REQUEST_ID, lease.request_id)
            async for message in request_iterator:
                part = message.WhichOneof("part")
                if part == "chunk":
                    c = message.chunk
                    receiver.receive(
                        KvChunkData(
                            c.layer_index, c.first_block, c.num_blocks, c.key, c.value, c.crc32c
                        )
                    )
                elif part == "commit":
                    receiver.commit(message.commit.num_chunks, message.commit.num_bytes)
                    self._commit(lease, header, message.commit)
                    self.num_kv_bytes_received += receiver.num_bytes
                    if self.metrics is not None:
                        self.metrics.sync_seconds.observe(time.perf_counter() - started)
                    trace.get_current_span().set_attributes(
                        {"pdserve.lease_id": lease.lease_id,
                         "pdserve.kv.num_bytes": receiver.num_bytes,
                         "pdserve.kv.num_chunks": receiver.num_chunks}
                    )  # fmt: skip
                    return decode_pb2.SyncCacheResponse(
                        lease_id=lease.lease_id,
                        state=decode_pb2.LEASE_STATE_COMMITTED,
                        num_chunks=receiver.num_chunks,
                        num_bytes=receiver.num_bytes,
                    )
                else:
                    raise receiver.failure(f"unexpected {part or 'empty'} message after the header")
            raise receiver.failure("stream ended without a commit", grpc.StatusCode.ABORTED)
        except PdserveError as error:
            self._fail_transfer(lease, error)
            await abort_with_error(context, error)
        except (asyncio.CancelledError, grpc.RpcError):
            # NOTE: the sender hung up mid-transfer; the partial cache must never be decoded.
            self._fail_transfer(
                lease,
                PdserveError(
                    ErrorReason.CACHE_SYNC_FAILED, "stream broken", code=grpc.StatusCode.ABORTED
                ),
            )
            raise

    async def _open_transfer(
        self, request_iterator: AsyncIterator[decode_pb2.SyncCacheRequest]
    ) -> tuple[Lease, KvReceiver, decode_pb2.SyncCacheHeader]:
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("part") != "header":
            raise PdserveError(
                ErrorReason.CACHE_SYNC_FAILED,
                "a SyncCache stream must start with a header",
                code=grpc.StatusCode.ABORTED,
            )
        header = first.header
        lease = self.leases.get(header.lease_id)
        if not self.leases.transition(lease, LeaseState.ALLOCATED, LeaseState.SYNCING):
            raise PdserveError(
                ErrorReason.CACHE_SYNC_FAILED,
                f"lease is {lease.state.name}, not ALLOCATED",
                {"leaseId": lease.lease_id},
            )
        receiver = KvReceiver(self.host.runner.kv_cache, lease)
        num_tokens = len(header.token_ids)
        if num_tokens != lease.num_prompt_tokens or header.num_prompt_tokens > num_tokens:
            raise receiver.failure(
                f"header carries {num_tokens} tokens (prompt {header.num_prompt_tokens}), "
                f"the lease was granted for {lease.num_prompt_tokens}"
            )
        return lease, receiver, header

    def _commit(
        self,
        lease: Lease,
        header: decode_pb2.SyncCacheHeader,
        commit: decode_pb2.SyncCacheCommit,
    ) -> None:
        num_prompt = header.num_prompt_tokens or len(header.token_ids)
        expected_index = len(header.token_ids) - num_prompt
        if commit.first_token_index != expected_index:
            raise PdserveError(
                ErrorReason.CACHE_SYNC_FAILED,
                f"first_token_index {commit.first_token_index}, expected {expected_index}",
                {"leaseId": lease.lease_id},
            )
        sampling = sampling_from_proto(header.sampling)
        stream = self.streams[lease.lease_id]
        if not self.leases.transition(lease, LeaseState.SYNCING, LeaseState.COMMITTED):
            raise PdserveError(
                ErrorReason.LEASE_EXPIRED,
                "lease ended during the transfer",
                {"leaseId": lease.lease_id},
            )
        aio_loop = asyncio.get_running_loop()
        token_ids = [*header.token_ids, commit.first_token_id]
        # NOTE: a child of this SyncCache call, whose commit starts the generation; it runs
        # until the request ends, well past the call (and past the gateway's Generate start).
        span = _tracer.start_span(
            "decode.generation",
            attributes={
                telemetry.REQUEST_ID: lease.request_id,
                "pdserve.lease_id": lease.lease_id,
                "pdserve.num_prompt_tokens": num_prompt,
                "pdserve.num_tokens": len(token_ids),
            },
        )
        self.loop.submit(
            DecodeRequest(
                lease=lease,
                token_ids=token_ids,
                num_prompt_tokens=num_prompt,
                sampling=sampling,
                # NOTE: the gateway always sets a seed; a missing one is resolved as the prefill
                # does, so that every instance continues the request the same way.
                seed=resolve_seed(sampling.seed),
                sink=lambda event: aio_loop.call_soon_threadsafe(stream.queue.put_nowait, event),
                span=span,
            )
        )
        stream.ready.set()
        log.info("lease_committed", request_id=lease.request_id, lease_id=lease.lease_id)

    def _fail_transfer(self, lease: Lease | None, error: PdserveError) -> None:
        if lease is None:
            return
        if self.leases.end(lease, LeaseState.FAILED):
            self._push(lease.lease_id, EndedEvent(LeaseState.FAILED, error.message, error.reason))
            log.warning(
                "cache_sync_failed",
                request_id=lease.request_id,
                lease_id=lease.lease_id,
                detail=error.message,
            )

    # ---- Generate --------------------------------------------------------------------------

    async def Generate(
        self,
        request: decode_pb2.DecodeServiceGenerateRequest,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[decode_pb2.DecodeServiceGenerateResponse]:
        """Streams a lease's tokens; waits for the commit, bounded by the lease TTL."""
        trace.get_current_span().set_attribute(telemetry.REQUEST_ID, request.request_id)
        stream = self.streams.get(request.lease_id)
        try:
            if stream is None:
                self.leases.get(request.lease_id)  # raises LEASE_NOT_FOUND / LEASE_EXPIRED
                raise PdserveError(ErrorReason.LEASE_NOT_FOUND, "no such lease")
            if stream.is_attached:
                raise PdserveError(
                    ErrorReason.INVALID_REQUEST,
                    "another Generate stream is attached to this lease",
                    {"leaseId": request.lease_id},
                )
            stream.is_attached = stream.lease.is_attached = True
            timeout = max(0.0, stream.lease.expires_at - time.monotonic())
            try:
                await asyncio.wait_for(stream.ready.wait(), timeout)
            except TimeoutError:
                if stream.queue.empty():
                    raise PdserveError(
                        ErrorReason.LEASE_EXPIRED,
                        "no commit within the lease TTL",
                        {"leaseId": request.lease_id},
                    ) from None
        except PdserveError as error:
            await abort_with_error(context, error)
        is_done = False
        try:
            while not is_done:
                events = [await stream.queue.get()]
                while not stream.queue.empty():
                    events.append(stream.queue.get_nowait())
                for message, error in convert.events_to_messages(events):
                    if error is not None:
                        is_done = True
                        await abort_with_error(context, error)
                    assert message is not None
                    kind = message.WhichOneof("event")
                    is_done = kind != "tokens"
                    if kind == "preemption":
                        count = message.preemption.num_generated_tokens
                        trace.get_current_span().add_event(
                            "preemption", {"pdserve.num_generated_tokens": count}
                        )
                    yield message
        finally:
            if not is_done:
                # NOTE: the client went away: release the lease (decode thread ends it).
                self._release(stream.lease, LeaseState.ABORTED)
            self.streams.pop(request.lease_id, None)

    # ---- ReleaseLease ----------------------------------------------------------------------

    async def ReleaseLease(
        self, request: decode_pb2.ReleaseLeaseRequest, context: grpc.aio.ServicerContext
    ) -> decode_pb2.ReleaseLeaseResponse:
        """Releases a lease in any state; idempotent."""
        trace.get_current_span().set_attribute(telemetry.REQUEST_ID, request.request_id)
        try:
            lease = self.leases.get(request.lease_id)
        except PdserveError:
            state = self.leases.ended_state(request.lease_id)
            return decode_pb2.ReleaseLeaseResponse(state=convert.lease_state_to_proto(state))
        self._release(lease, LeaseState.ABORTED)
        log.info("lease_released", request_id=lease.request_id, lease_id=lease.lease_id)
        return decode_pb2.ReleaseLeaseResponse(state=decode_pb2.LEASE_STATE_ABORTED)

    # ---- shared helpers --------------------------------------------------------------------

    def _release(self, lease: Lease, state: LeaseState, detail: str = "") -> None:
        """Ends a lease from the event loop: directly unless the decode thread owns it."""
        with self.leases.lock:
            if lease.state is LeaseState.RUNNING:
                self.loop.abort(lease.lease_id, state, detail)
                return
            # NOTE: a COMMITTED lease may sit in the loop's queue; ending it here makes the
            # loop's COMMITTED -> RUNNING admission fail, so it is never decoded.
            is_ended = self.leases.end(lease, state)
        if is_ended:
            self._push(lease.lease_id, EndedEvent(state, detail))

    def _push(self, lease_id: str, event: DecodeEvent) -> None:
        stream = self.streams.get(lease_id)
        if stream is not None:
            stream.queue.put_nowait(event)
            stream.ready.set()

    def expire_due(self) -> int:
        """Reclaims leases past their TTL; forgets streams nobody attached to. Returns count."""
        expired = self.leases.due_for_expiry()
        for lease in expired:
            log.info("lease_expired", request_id=lease.request_id, lease_id=lease.lease_id)
            self._release(lease, LeaseState.EXPIRED, "lease TTL ran out")
        now = time.monotonic()
        for lease_id, stream in list(self.streams.items()):
            if stream.is_attached or not stream.lease.state.is_terminal:
                continue
            if stream.ended_at is None:
                stream.ended_at = now
            elif stream.ended_at < now - self.leases.ttl_s:
                del self.streams[lease_id]  # ended and never attached: nobody will read it
        return len(expired)


async def run_expiry_sweeper(servicer: DecodeServicer, interval_s: float) -> None:
    """Background task: reclaims expired leases every `interval_s` until cancelled."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            servicer.expire_due()
        except Exception as error:
            log.exception("expiry_sweep_failed", error=str(error))
