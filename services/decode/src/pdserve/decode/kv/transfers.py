"""One KV transfer into a lease, whatever carries it: begin (token checked), commit, fail.

The SyncCache servicer (chunks in the stream, or written into the cache by a sender that maps it:
shared memory, CUDA IPC) and the TCP data port (`pdserve.decode.kv.tcp_server`) both open a transfer
with `begin`, feed its `KvReceiver`, and finish with `commit` or `fail`, then `end`. From `begin` to
`end` the lease's blocks stay reserved even if the lease ends meanwhile (expiry, release): a writer
may still be filling them, and they must not go to another lease before it stopped."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from dataclasses import dataclass, field

import structlog

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import resolve_seed
from pdserve.common.pki import Identity
from pdserve.decode.decode_loop import DecodeLoop
from pdserve.decode.events import EndedEvent
from pdserve.decode.kv.receiver import KvReceiver
from pdserve.decode.lease_state import RequestStatus
from pdserve.decode.leases import LeaseManager
from pdserve.decode.metrics import DecodeMetrics
from pdserve.decode.request import DecodeRequest
from pdserve.engine.constraints import ConstraintCompiler, ConstraintState
from pdserve.engine.kv_cache import KVCache
from pdserve.serving.convert import constraint_from_proto, sampling_from_proto
from pdserve.v1 import decode_pb2

log = structlog.get_logger(__name__)

TRANSPORT_NAMES = {
    decode_pb2.TRANSPORT_KIND_UNSPECIFIED: "grpc",
    decode_pb2.TRANSPORT_KIND_GRPC_SYNC_CACHE: "grpc",
    decode_pb2.TRANSPORT_KIND_TCP: "tcp",
    decode_pb2.TRANSPORT_KIND_SHARED_MEMORY: "shm",
    decode_pb2.TRANSPORT_KIND_CUDA_IPC: "cuda_ipc",
    decode_pb2.TRANSPORT_KIND_NIXL: "nixl",
}
# Transports whose sender writes into the cache itself; the stream names what it wrote.
WRITTEN_IN_PLACE = (
    decode_pb2.TRANSPORT_KIND_SHARED_MEMORY,
    decode_pb2.TRANSPORT_KIND_CUDA_IPC,
    decode_pb2.TRANSPORT_KIND_NIXL,
)
# Of those, the ones whose writes may still land after the sender's process died (copies queued
# on its GPU, WRITEs on the wire): a broken stream keeps the blocks a little longer.
WRITTEN_FROM_AFAR = (decode_pb2.TRANSPORT_KIND_CUDA_IPC, decode_pb2.TRANSPORT_KIND_NIXL)


@dataclass(eq=False)
class Transfers:
    """Opens, commits and fails the transfers into one decode's leases.

    Args:
        kv_cache: The decode's cache.
        leases: The lease table.
        loop: The decode thread (committed requests are submitted to it).
        metrics: Where transfer durations are observed, if anywhere.
        constraints: Compiles the constraints of constrained requests (None: the model has no
            tokenizer.json and such a transfer fails with INVALID_REQUEST).
    """

    kv_cache: KVCache
    leases: LeaseManager
    loop: DecodeLoop
    metrics: DecodeMetrics | None = None
    constraints: ConstraintCompiler | None = None
    num_kv_bytes_received: int = field(default=0, init=False)
    # NOTE: lease id -> its constraint, compiled while the KV arrives (from `begin`).
    _constraints: dict[str, concurrent.futures.Future[ConstraintState]] = field(
        default_factory=dict, init=False, repr=False
    )

    def begin(
        self,
        header: decode_pb2.SyncCacheHeader,
        caller: Identity | None,
        *,
        is_token_only: bool = False,
    ) -> tuple[DecodeRequest, KvReceiver]:
        """Moves the header's lease to SYNCING (token and caller checked) and returns it with
        its receiver; `end` must follow.

        Raises:
            PdserveError: PERMISSION_DENIED (lease unchanged), LEASE_NOT_FOUND /
                LEASE_EXPIRED, or CACHE_SYNC_FAILED for a header that does not fit the lease
                (the lease then failed).
        """
        lease = self.leases.begin_sync(
            header.lease_id, header.transport_token, caller, is_token_only=is_token_only
        )
        receiver = KvReceiver(self.kv_cache, lease)
        try:
            receiver.check_header(header.token_ids, header.num_prompt_tokens)
            self._prepare_constraint(lease, header)
        except PdserveError as error:
            self.fail(lease, error)
            self.end(lease)
            raise
        return lease, receiver

    def _prepare_constraint(self, lease: DecodeRequest, header: decode_pb2.SyncCacheHeader) -> None:
        if not header.sampling.HasField("constraint"):
            return
        if self.constraints is None:
            raise PdserveError(
                ErrorReason.INVALID_REQUEST,
                "this decode's model has no tokenizer.json: it cannot apply a constraint",
                {"leaseId": lease.lease_id},
            )
        try:
            constraint = constraint_from_proto(header.sampling.constraint)
        except ValueError as error:
            raise PdserveError(ErrorReason.INVALID_REQUEST, str(error)) from None
        num_prompt = header.num_prompt_tokens or len(header.token_ids)
        completion = list(header.token_ids[num_prompt:])
        self._constraints[lease.lease_id] = self.constraints.prepare(constraint, completion)

    async def constraint_compiled(self, lease: DecodeRequest) -> None:
        """Waits until the lease's constraint (if any) is compiled; `commit` may follow."""
        future = self._constraints.get(lease.lease_id)
        if future is not None:
            await asyncio.wait([asyncio.wrap_future(future)])

    def wait_constraint_compiled(self, lease: DecodeRequest, timeout_s: float) -> None:
        """`constraint_compiled` for a thread that may block (the TCP data port's)."""
        future = self._constraints.get(lease.lease_id)
        if future is not None:
            concurrent.futures.wait([future], timeout_s)

    def _constraint_state(self, lease: DecodeRequest) -> ConstraintState | None:
        """The lease's compiled constraint (`constraint_compiled` was awaited).

        Raises:
            PdserveError: INVALID_REQUEST when it did not compile (or replay) here, or
                CACHE_SYNC_FAILED when the commit came before its compilation ended.
        """
        future = self._constraints.pop(lease.lease_id, None)
        if future is None:
            return None
        if not future.done():
            future.cancel()
            raise PdserveError(
                ErrorReason.CACHE_SYNC_FAILED, "committed before its constraint compiled"
            )
        return future.result()

    def commit(
        self,
        lease: DecodeRequest,
        receiver: KvReceiver,
        header: decode_pb2.SyncCacheHeader,
        commit: decode_pb2.SyncCacheCommit,
        started: float,
    ) -> decode_pb2.SyncCacheResponse:
        """Verifies the commit and hands the request to the decode loop (event loop only).

        Raises:
            PdserveError: CACHE_SYNC_FAILED for a short or inconsistent transfer;
                LEASE_EXPIRED when the lease ended meanwhile.
        """
        receiver.check_open()
        num_prompt = header.num_prompt_tokens or len(header.token_ids)
        receiver.commit(
            commit.num_chunks,
            commit.num_bytes,
            commit.first_token_index,
            expected_index=len(header.token_ids) - num_prompt,
        )
        constraint_state = self._constraint_state(lease)
        if not self.leases.table.advance(lease, RequestStatus.COMMITTED):
            raise PdserveError(
                ErrorReason.LEASE_EXPIRED,
                "lease ended during the transfer",
                {"leaseId": lease.lease_id},
            )
        sampling = sampling_from_proto(header.sampling)
        # NOTE: the gateway always sets a seed; a missing one is resolved as the prefill does,
        # so that every instance continues the request the same way.
        lease.start_generation(
            [*header.token_ids, commit.first_token_id],
            num_prompt,
            sampling,
            resolve_seed(sampling.seed),
            constraint_state,
        )
        self.loop.submit(lease)
        lease.events.ready.set()
        self.num_kv_bytes_received += receiver.num_bytes
        if self.metrics is not None:
            self.metrics.sync_seconds.observe(time.perf_counter() - started)
        log.info(
            "lease_committed",
            request_id=lease.request_id,
            lease_id=lease.lease_id,
            transport=TRANSPORT_NAMES.get(header.transport, "grpc"),
        )
        return decode_pb2.SyncCacheResponse(
            lease_id=lease.lease_id,
            state=decode_pb2.LEASE_STATE_COMMITTED,
            num_chunks=receiver.num_chunks,
            num_bytes=receiver.num_bytes,
        )

    def fail(self, lease: DecodeRequest | None, error: PdserveError) -> None:
        """Ends `lease` FAILED (if still open) because its transfer failed with `error`."""
        if lease is None:
            return
        if self.leases.table.end(lease, RequestStatus.FAILED):
            lease.events.deliver(EndedEvent(RequestStatus.FAILED, error.message, error.reason))
            log.warning(
                "cache_sync_failed",
                request_id=lease.request_id,
                lease_id=lease.lease_id,
                detail=error.message,
            )

    def end(self, lease: DecodeRequest) -> None:
        """The transfer stopped writing into `lease` (frees its blocks if it ended meanwhile)."""
        future = self._constraints.pop(lease.lease_id, None)
        if future is not None:
            future.cancel()
        self.leases.table.end_sync(lease)
