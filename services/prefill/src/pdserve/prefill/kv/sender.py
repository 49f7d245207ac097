"""The KV sender: ships one request's KV to its decode as the engine produces it.

The transfer opens as soon as the lease is granted, on the first transport both ends can use
(`transports.channels_for`: shared memory when the decode is on this host, then its TCP data
port, then gRPC SyncCache); a transport that cannot be opened falls back to the next without
touching the lease. Then every `KvPiece` the engine thread exports (layer by layer, while later
layers still compute) goes out, then the commit with the chunk count, byte total and first
token once the engine sampled it. `run()` returns when the decode acknowledged the commit.

`SyncCacheMessages` builds the messages of an in-stream SyncCache transfer;
`sync_cache_messages` is that stream for a sequence computed before it is sent, for tests and
benchmarks that drive the decode themselves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import structlog

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.engine.kv_cache import KVCache
from pdserve.kv.transfer import KvPiece, sequence_pieces
from pdserve.prefill import convert
from pdserve.prefill.kv.channels import KvChannel, TransportUnavailable
from pdserve.prefill.request import Request
from pdserve.v1 import decode_pb2

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class _Commit:
    first_token_id: int
    first_token_index: int


@dataclass(frozen=True)
class TransferResult:
    """What the decode acknowledged, and on which transport."""

    num_chunks: int
    num_bytes: int
    transport: str


class SyncCacheMessages:
    """The messages of one request's in-stream SyncCache transfer, in order, and the counts its
    commit states.

    Args:
        request: The request (holding its lease).
    """

    def __init__(self, request: Request) -> None:
        self.request = request
        self.num_chunks = 0
        self.num_bytes = 0

    def header(self) -> decode_pb2.SyncCacheRequest:
        """The first message."""
        return convert.sync_header(self.request)

    def chunk(self, piece: KvPiece) -> decode_pb2.SyncCacheRequest:
        """The chunk message of `piece` with its CRC-32C, counted for the commit."""
        message = convert.kv_chunk(piece)
        self.num_chunks += 1
        self.num_bytes += len(message.chunk.key) + len(message.chunk.value)
        return message

    def commit(self, first_token_id: int, first_token_index: int) -> decode_pb2.SyncCacheRequest:
        """The last message: every chunk built so far, and the first token."""
        return convert.sync_commit(
            self.num_chunks, self.num_bytes, first_token_id, first_token_index
        )


def sync_cache_messages(
    request: Request,
    kv_cache: KVCache,
    first_token_id: int,
    max_chunk_bytes: int,
    window_layers: frozenset[int] = frozenset(),
) -> Iterator[decode_pb2.SyncCacheRequest]:
    """The whole SyncCache stream for `request` when its KV was computed in one pass.

    Args:
        request: The request (holding its lease); ``block_ids`` hold its KV in `kv_cache`
            (the blocks the lease shares on the decode are left out).
        kv_cache: The sender's cache.
        first_token_id: The sampled first token (the commit's).
        max_chunk_bytes: Most K+V bytes per chunk, as the prefill's flag.
        window_layers: The model's sliding-window layers (the lease may skip their leading
            blocks).
    """
    messages = SyncCacheMessages(request)
    yield messages.header()
    lease = request.lease
    num_shared = 0 if lease is None else lease.num_shared_blocks
    num_skipped = 0 if lease is None else lease.num_window_skipped_blocks
    for piece in sequence_pieces(
        kv_cache, request.block_ids, max_chunk_bytes, num_shared, window_layers, num_skipped
    ):
        yield messages.chunk(piece)
    yield messages.commit(first_token_id, request.first_token_index)


class KvSender:
    """One KV transfer, on the first of `channels` that opens.

    Args:
        request: The request (holding its lease).
        channels: Candidate channels in order of preference (`transports.channels_for`).
        corrupt_first_chunk: Fault injection: flip a byte of the first chunk after its checksum.
    """

    def __init__(
        self,
        request: Request,
        channels: Sequence[KvChannel],
        *,
        corrupt_first_chunk: bool = False,
    ) -> None:
        if not channels:
            raise ValueError("a KV sender needs at least one channel")
        self.request = request
        self.channels = list(channels)
        self.corrupt_first_chunk = corrupt_first_chunk
        self.transport = ""  # the channel in use, once one opened
        self.transport_reason = ""  # why that one: the first candidate, or what failed before
        self.num_chunks = 0
        self.num_bytes = 0
        self._queue: asyncio.Queue[KvPiece | _Commit] = asyncio.Queue()

    def put(self, piece: KvPiece) -> None:
        """Queues a piece of KV (event loop only)."""
        self._queue.put_nowait(piece)

    def commit(self, first_token_id: int, first_token_index: int) -> None:
        """Queues the commit: the last message once every queued piece is sent."""
        self._queue.put_nowait(_Commit(first_token_id, first_token_index))

    async def run(self) -> TransferResult:
        """Opens a channel, sends every piece and the commit; returns once the decode
        committed.

        Raises:
            PdserveError: The decode's reason (CACHE_SYNC_FAILED, LEASE_EXPIRED, ...),
                PEER_UNAVAILABLE when the connection broke, or CACHE_SYNC_FAILED when no
                transport could be opened.
        """
        channel = await self._open()
        try:
            while True:
                item = await self._queue.get()
                # NOTE: everything already queued goes in one call (one worker hop for the
                # socket and shared-memory channels).
                pieces: list[KvPiece] = []
                while isinstance(item, KvPiece):
                    pieces.append(item)
                    if self._queue.empty():
                        break
                    item = self._queue.get_nowait()
                if pieces:
                    self.num_chunks += await channel.send(
                        pieces, corrupt_first=self.corrupt_first_chunk and not self.num_chunks
                    )
                    self.num_bytes += sum(len(p.key) + len(p.value) for p in pieces)
                if isinstance(item, _Commit):
                    await channel.finish(
                        item.first_token_id, item.first_token_index, self.num_chunks, self.num_bytes
                    )
                    return TransferResult(self.num_chunks, self.num_bytes, channel.name)
        finally:
            channel.close()

    async def _open(self) -> KvChannel:
        skipped: list[str] = []
        for channel in self.channels:
            try:
                await channel.open()
            except TransportUnavailable as why:
                channel.close()
                log.info(
                    "kv_transport_fallback",
                    request_id=self.request.request_id,
                    transport=channel.name,
                    detail=str(why),
                )
                skipped.append(f"{channel.name}: {why}")
                continue
            except BaseException:
                channel.close()
                raise
            self.transport = channel.name
            self.transport_reason = (
                "fell back after " + "; ".join(skipped)
                if skipped
                else f"first of {', '.join(c.name for c in self.channels)} (both ends have it)"
            )
            return channel
        raise PdserveError(
            ErrorReason.CACHE_SYNC_FAILED,
            "no KV transport could be opened to the decode",
            {"requestId": self.request.request_id, "decodeAddress": self.request.decode_address},
        )
