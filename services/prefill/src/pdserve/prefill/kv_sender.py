"""The SyncCache sender: ships one request's KV to its decode as the engine produces it.

The stream opens as soon as the lease is granted: header first, then every `KvPiece` the engine
thread exports (layer by layer, while later layers still compute), then the commit with the
chunk count, byte total and first token once the engine sampled it. `run()` returns when the
decode acknowledged the commit.

`SyncCacheMessages` builds the messages (chunks with their CRC-32C) and the commit's counts;
`KvSender` writes them. `sync_cache_messages` is the same stream for a sequence computed before
it is sent, for tests and benchmarks that drive the decode themselves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import structlog

from pdserve.common import telemetry
from pdserve.common.errors import ErrorReason, PdserveError, has_error_info
from pdserve.engine.kv_cache import KVCache
from pdserve.prefill import convert
from pdserve.prefill.decode_client import RELEASE_TIMEOUT_S, peer_error
from pdserve.prefill.request import Request
from pdserve.serving.kv_transfer import KvPiece, sequence_pieces
from pdserve.v1 import decode_pb2, decode_pb2_grpc

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class _Commit:
    first_token_id: int
    first_token_index: int


class _StreamEnded(Exception):
    """A write found the stream already ended by the decode."""


@dataclass(frozen=True)
class TransferResult:
    """What the decode acknowledged."""

    num_chunks: int
    num_bytes: int


class SyncCacheMessages:
    """The messages of one request's SyncCache stream, in order, and the counts its commit states.

    Args:
        request: The request (holding its lease).
        corrupt_first_chunk: Fault injection: flip a byte of the first chunk after its checksum.
    """

    def __init__(self, request: Request, *, corrupt_first_chunk: bool = False) -> None:
        self.request = request
        self.corrupt_first_chunk = corrupt_first_chunk
        self.num_chunks = 0
        self.num_bytes = 0

    def header(self) -> decode_pb2.SyncCacheRequest:
        """The first message."""
        return convert.sync_header(self.request)

    def chunk(self, piece: KvPiece) -> decode_pb2.SyncCacheRequest:
        """The chunk message of `piece` with its CRC-32C, counted for the commit."""
        corrupt = self.corrupt_first_chunk and self.num_chunks == 0
        message = convert.kv_chunk(piece, corrupt=corrupt)
        self.num_chunks += 1
        self.num_bytes += len(message.chunk.key) + len(message.chunk.value)
        return message

    def commit(self, first_token_id: int, first_token_index: int) -> decode_pb2.SyncCacheRequest:
        """The last message: every chunk built so far, and the first token."""
        return convert.sync_commit(
            self.num_chunks, self.num_bytes, first_token_id, first_token_index
        )


def sync_cache_messages(
    request: Request, kv_cache: KVCache, first_token_id: int, max_chunk_bytes: int
) -> Iterator[decode_pb2.SyncCacheRequest]:
    """The whole stream `KvSender` writes for `request` when its KV was computed in one pass.

    Args:
        request: The request (holding its lease); ``block_ids`` hold its KV in `kv_cache`.
        kv_cache: The sender's cache.
        first_token_id: The sampled first token (the commit's).
        max_chunk_bytes: Most K+V bytes per chunk, as the prefill's flag.
    """
    messages = SyncCacheMessages(request)
    yield messages.header()
    for piece in sequence_pieces(kv_cache, request.block_ids, max_chunk_bytes):
        yield messages.chunk(piece)
    yield messages.commit(first_token_id, request.first_token_index)


class KvSender:
    """One SyncCache transfer.

    Args:
        stub: The target decode's DecodeService stub.
        request: The request (holding its lease).
        corrupt_first_chunk: Fault injection: flip a byte of the first chunk after its checksum.
    """

    def __init__(
        self,
        stub: decode_pb2_grpc.DecodeServiceStub,
        request: Request,
        *,
        corrupt_first_chunk: bool = False,
    ) -> None:
        self.stub = stub
        self.request = request
        self.messages = SyncCacheMessages(request, corrupt_first_chunk=corrupt_first_chunk)
        self._queue: asyncio.Queue[KvPiece | _Commit] = asyncio.Queue()

    @property
    def num_chunks(self) -> int:
        """Chunks handed to the stream so far."""
        return self.messages.num_chunks

    @property
    def num_bytes(self) -> int:
        """K+V bytes of those chunks."""
        return self.messages.num_bytes

    def put(self, piece: KvPiece) -> None:
        """Queues a piece of KV (event loop only)."""
        self._queue.put_nowait(piece)

    def commit(self, first_token_id: int, first_token_index: int) -> None:
        """Queues the commit: the last message once every queued piece is sent."""
        self._queue.put_nowait(_Commit(first_token_id, first_token_index))

    async def run(self) -> TransferResult:
        """Streams header, pieces and commit; returns once the decode committed.

        Raises:
            PdserveError: The decode's reason (CACHE_SYNC_FAILED, LEASE_EXPIRED, ...), or
                PEER_UNAVAILABLE when the stream broke.
        """
        address = self.request.decode_address
        call = self.stub.SyncCache(metadata=telemetry.outgoing_metadata())
        try:
            await self._write(call, self.messages.header())
            while True:
                item = await self._queue.get()
                if isinstance(item, _Commit):
                    commit = self.messages.commit(item.first_token_id, item.first_token_index)
                    await self._write(call, commit)
                    await call.done_writing()
                    response: decode_pb2.SyncCacheResponse = await call
                    break
                await self._write(call, self.messages.chunk(item))
        except asyncio.CancelledError:
            call.cancel()
            raise
        except _StreamEnded:
            # NOTE: the decode ended the stream early (e.g. a bad checksum); the call's final
            # status says why, the failed write does not.
            raise await self._final_error(call, address) from None
        except grpc.RpcError as error:
            raise peer_error(error, address, "SyncCache") from None
        if response.state != decode_pb2.LEASE_STATE_COMMITTED:
            raise PdserveError(
                ErrorReason.CACHE_SYNC_FAILED,
                f"decode answered {decode_pb2.LeaseState.Name(response.state)}, not COMMITTED",
                {"requestId": self.request.request_id, "decodeAddress": address},
            )
        return TransferResult(self.num_chunks, self.num_bytes)

    @staticmethod
    async def _write(call: grpc.aio.StreamUnaryCall, message: decode_pb2.SyncCacheRequest) -> None:
        try:
            await call.write(message)
        except (grpc.RpcError, asyncio.InvalidStateError):
            raise _StreamEnded from None

    async def _final_error(self, call: grpc.aio.StreamUnaryCall, address: str) -> PdserveError:
        try:
            await call
        except grpc.RpcError as error:
            if has_error_info(error):
                return peer_error(error, address, "SyncCache")
            # NOTE: a write that loses the race with the decode's early status makes grpc.aio
            # replace that status with a local INTERNAL error; the lease says what happened.
            return await self._ask_lease_state(address, peer_error(error, address, "SyncCache"))
        return PdserveError(
            ErrorReason.CACHE_SYNC_FAILED, "SyncCache ended early", {"decodeAddress": address}
        )

    async def _ask_lease_state(self, address: str, local: PdserveError) -> PdserveError:
        """Classifies a stream the decode ended by the lease's state (ReleaseLease, idempotent)."""
        lease = self.request.lease
        assert lease is not None
        metadata = {"requestId": self.request.request_id, "decodeAddress": address}
        try:
            response = await self.stub.ReleaseLease(
                decode_pb2.ReleaseLeaseRequest(
                    lease_id=lease.lease_id,
                    request_id=self.request.request_id,
                    lease_token=lease.transport_token,
                ),
                timeout=RELEASE_TIMEOUT_S,
            )
        except grpc.RpcError as error:
            return peer_error(error, address, "SyncCache")
        if response.state == decode_pb2.LEASE_STATE_EXPIRED:
            return PdserveError(
                ErrorReason.LEASE_EXPIRED, "the lease expired during SyncCache", metadata
            )
        if response.state in (decode_pb2.LEASE_STATE_FAILED, decode_pb2.LEASE_STATE_ABORTED):
            state = decode_pb2.LeaseState.Name(response.state)
            return PdserveError(
                ErrorReason.CACHE_SYNC_FAILED, f"the decode ended SyncCache ({state})", metadata
            )
        return local
