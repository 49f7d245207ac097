"""The ways KV reaches a decode over its SyncCache RPC: in the stream, or through shared memory.

A channel is one transfer on one transport (`KvChannel`): `open` it (a `TransportUnavailable`
from `open` means nothing touched the lease, so the sender may try the next transport), `send`
the pieces in order (in batches of what is ready), `finish` with the commit, or `close` it when
the transfer is abandoned. `corrupt_first` flips a byte of a batch's first piece after its
checksum (fault injection).

* `GrpcChannel`: header, chunks with their bytes, commit, all in the SyncCache stream.
* `InPlaceChannel`: the sender writes into the decode's cache itself; the header goes out
  first and the pieces are written into the lease's blocks only after the decode accepted it
  (its initial metadata), each run of a layer's blocks announced by a chunk message without
  bytes once it landed (its checksum, which the decode verifies in its cache while later layers
  compute). An abandoned transfer waits for a copy under way before the stream is cancelled:
  until the stream ends the decode keeps the blocks reserved, so no late write can reach
  another lease. Two kinds:
  `pdserve.prefill.kv.shm.SharedMemoryChannel` (the decode's KV cache is a segment on
  this host) and
  `pdserve.prefill.kv.cuda_ipc.CudaIpcChannel` (the decode's CUDA cache mapped through CUDA
  IPC).
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Sequence
from typing import Protocol

import grpc

from pdserve.common import telemetry
from pdserve.common.errors import ErrorReason, PdserveError, has_error_info
from pdserve.kv.transfer import SYNC_ACCEPTED_KEY, KvPiece, chunk_runs, run_crc32c
from pdserve.prefill import convert
from pdserve.prefill.decode_client import RELEASE_TIMEOUT_S, peer_error
from pdserve.prefill.request import Request
from pdserve.v1 import decode_pb2, decode_pb2_grpc

# Most K+V bytes the shared-memory channel copies before it announces them.
GROUP_BYTES = 8 << 20


class TransportUnavailable(Exception):
    """The transport cannot be used for this lease; nothing was sent on it."""


class KvChannel(Protocol):
    """One transfer's channel to the decode (see the module docstring)."""

    name: str

    async def open(self) -> None: ...

    async def send(self, pieces: Sequence[KvPiece], *, corrupt_first: bool = False) -> int: ...

    async def finish(
        self, first_token_id: int, first_token_index: int, num_chunks: int, num_bytes: int
    ) -> None: ...

    def close(self) -> None: ...


class GrpcChannel:
    """SyncCache with the chunks in the stream.

    Args:
        stub: The decode's stub.
        request: The request (holding its lease).
    """

    name = "grpc"

    def __init__(self, stub: decode_pb2_grpc.DecodeServiceStub, request: Request) -> None:
        self.stub = stub
        self.request = request
        self.call: grpc.aio.StreamUnaryCall | None = None

    async def open(self) -> None:
        self.call = self.stub.SyncCache(metadata=telemetry.outgoing_metadata())
        await self._write(convert.sync_header(self.request, self.name))

    async def send(self, pieces: Sequence[KvPiece], *, corrupt_first: bool = False) -> int:
        for i, piece in enumerate(pieces):
            await self._write(convert.kv_chunk(piece, corrupt=corrupt_first and i == 0))
        return len(pieces)

    async def finish(
        self, first_token_id: int, first_token_index: int, num_chunks: int, num_bytes: int
    ) -> None:
        await self._write(
            convert.sync_commit(num_chunks, num_bytes, first_token_id, first_token_index)
        )
        assert self.call is not None
        try:
            await self.call.done_writing()
            response: decode_pb2.SyncCacheResponse = await self.call
        except grpc.RpcError as error:
            raise peer_error(error, self.request.decode_address, "SyncCache") from None
        if response.state != decode_pb2.LEASE_STATE_COMMITTED:
            raise PdserveError(
                ErrorReason.CACHE_SYNC_FAILED,
                f"decode answered {decode_pb2.LeaseState.Name(response.state)}, not COMMITTED",
                {
                    "requestId": self.request.request_id,
                    "decodeAddress": self.request.decode_address,
                },
            )

    def close(self) -> None:
        if self.call is not None:
            self.call.cancel()

    async def _write(self, message: decode_pb2.SyncCacheRequest) -> None:
        assert self.call is not None
        try:
            await self.call.write(message)
        except (grpc.RpcError, asyncio.InvalidStateError):
            # NOTE: the decode ended the stream early (e.g. a bad checksum); the call's final
            # status says why, the failed write does not.
            raise await self._final_error() from None

    async def _final_error(self) -> PdserveError:
        assert self.call is not None
        address = self.request.decode_address
        try:
            await self.call
        except grpc.RpcError as error:
            if has_error_info(error):
                return peer_error(error, address, "SyncCache")
            # NOTE: a write that loses the race with the decode's early status makes grpc.aio
            # replace that status with a local INTERNAL error; the lease says what happened.
            return await ask_lease_state(
                self.stub, self.request, peer_error(error, address, "SyncCache")
            )
        return PdserveError(
            ErrorReason.CACHE_SYNC_FAILED, "SyncCache ended early", {"decodeAddress": address}
        )


class BlockWriter(Protocol):
    """Writes a lease's pieces into the decode's cache (a shared-memory `LeaseWindow`, or a
    CUDA IPC `CacheWindow`), without checksumming them (the channel checksums its runs)."""

    def take(self, piece: KvPiece, *, corrupt: bool = False) -> None: ...


class InPlaceChannel(GrpcChannel, abc.ABC):
    """SyncCache whose chunks the sender writes into the decode's cache itself, each announced
    by a chunk message without bytes once it landed (the module docstring says the order).

    Subclasses open the writer of the lease's blocks (`_open_writer`) and may wait for queued
    copies before they are announced (`_wait_landed`).
    """

    def __init__(self, stub: decode_pb2_grpc.DecodeServiceStub, request: Request) -> None:
        super().__init__(stub, request)
        self.window: BlockWriter | None = None

    @abc.abstractmethod
    def _open_writer(self) -> BlockWriter:
        """The writer of this lease's blocks.

        Raises:
            TransportUnavailable: The decode's cache cannot be reached from here.
        """

    def _wait_landed(self) -> None:
        """Returns once every write so far is in the decode's cache."""

    async def open(self) -> None:
        self.window = self._open_writer()
        await super().open()
        assert self.call is not None
        metadata = await self.call.initial_metadata()
        if SYNC_ACCEPTED_KEY not in dict(metadata or ()):
            raise await self._final_error()

    async def send(self, pieces: Sequence[KvPiece], *, corrupt_first: bool = False) -> int:
        # NOTE: in groups of a few MiB, so that the decode checksums one group while the next
        # one is copied; each run of a layer's blocks in a group is announced as one chunk.
        num_chunks = 0
        for group in piece_groups(pieces, GROUP_BYTES):
            copy = asyncio.ensure_future(asyncio.to_thread(self._write_all, group, corrupt_first))
            corrupt_first = False
            try:
                checked = await asyncio.shield(copy)
            except asyncio.CancelledError:
                await asyncio.wait([copy])  # NOTE: never leave a copy running (module doc)
                raise
            for run, crc in checked:
                await self._write(convert.kv_chunk_meta(run, crc))
            num_chunks += len(checked)
        return num_chunks

    def _write_all(
        self, pieces: Sequence[KvPiece], corrupt_first: bool
    ) -> list[tuple[list[KvPiece], int]]:
        """Writes `pieces`, waits until they landed; returns their runs with the checksums."""
        assert self.window is not None
        for i, piece in enumerate(pieces):
            self.window.take(piece, corrupt=corrupt_first and i == 0)
        self._wait_landed()
        return [(run, run_crc32c(run)) for run in chunk_runs(pieces)]


def piece_groups(pieces: Sequence[KvPiece], max_bytes: int) -> list[list[KvPiece]]:
    """`pieces` in order, in runs of at most `max_bytes` of K+V (at least one piece each)."""
    groups: list[list[KvPiece]] = []
    size = max_bytes
    for piece in pieces:
        nbytes = len(piece.key) + len(piece.value)
        if size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(piece)
        size += nbytes
    return groups


async def ask_lease_state(
    stub: decode_pb2_grpc.DecodeServiceStub, request: Request, local: PdserveError
) -> PdserveError:
    """Classifies a transfer the decode ended without saying why, by the lease's state
    (ReleaseLease, idempotent): LEASE_EXPIRED, CACHE_SYNC_FAILED, or `local`."""
    lease = request.lease
    assert lease is not None
    address = request.decode_address
    metadata = {"requestId": request.request_id, "decodeAddress": address}
    try:
        response = await stub.ReleaseLease(
            decode_pb2.ReleaseLeaseRequest(
                lease_id=lease.lease_id,
                request_id=request.request_id,
                lease_token=lease.transport_token,
            ),
            timeout=RELEASE_TIMEOUT_S,
        )
    except grpc.RpcError as error:
        return peer_error(error, address, "SyncCache")
    if response.state == decode_pb2.LEASE_STATE_EXPIRED:
        return PdserveError(
            ErrorReason.LEASE_EXPIRED, "the lease expired during the transfer", metadata
        )
    if response.state in (decode_pb2.LEASE_STATE_FAILED, decode_pb2.LEASE_STATE_ABORTED):
        state = decode_pb2.LeaseState.Name(response.state)
        return PdserveError(
            ErrorReason.CACHE_SYNC_FAILED, f"the decode ended the transfer ({state})", metadata
        )
    return local
