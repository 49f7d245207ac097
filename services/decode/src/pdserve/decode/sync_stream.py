"""One SyncCache stream as the decode reads it: the header first, then chunks until the commit.

The header names the lease, its token, the tokens whose KV follows and how the bytes travel (a
TCP transfer goes to the data port, never here). Each chunk carries its bytes in the stream,
or, over shared memory or CUDA IPC, names blocks the sender already wrote into the cache;
those checksums are computed on a worker while the next chunks come, and compared once the
commit arrived (`transfers` commits or fails it).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.decode.kv.receiver import CHECKSUM_WORKERS, KvChunkData, KvChunkMeta, KvReceiver
from pdserve.decode.kv.transfers import WRITTEN_IN_PLACE
from pdserve.v1 import decode_pb2


async def read_header(
    request_iterator: AsyncIterator[decode_pb2.SyncCacheRequest],
) -> decode_pb2.SyncCacheHeader:
    """The stream's first message, which must be a header for this stream's transports."""
    first = await anext(aiter(request_iterator), None)
    if first is None or first.WhichOneof("part") != "header":
        raise PdserveError(
            ErrorReason.CACHE_SYNC_FAILED,
            "a SyncCache stream must start with a header",
            code=grpc.StatusCode.ABORTED,
        )
    if first.header.transport == decode_pb2.TRANSPORT_KIND_TCP:
        raise PdserveError(
            ErrorReason.CACHE_SYNC_FAILED,
            "a TCP transfer goes to the data port, not to SyncCache",
            code=grpc.StatusCode.INVALID_ARGUMENT,
        )
    return first.header


async def receive_chunks(
    request_iterator: AsyncIterator[decode_pb2.SyncCacheRequest],
    receiver: KvReceiver,
    transport: decode_pb2.TransportKind,
) -> tuple[decode_pb2.SyncCacheCommit, list[tuple[KvChunkMeta, asyncio.Future[int]]]]:
    """Takes chunks until the commit; returns it with the checksums still to compare.
    Shared memory and CUDA IPC: a chunk without bytes names blocks the sender wrote; their
    checksum is computed in the cache on a worker while the next ones come."""
    is_shared = transport in WRITTEN_IN_PLACE
    checks: list[tuple[KvChunkMeta, asyncio.Future[int]]] = []
    async for message in request_iterator:
        part = message.WhichOneof("part")
        if part == "chunk":
            c = message.chunk
            if not is_shared:
                receiver.receive(
                    KvChunkData(
                        c.layer_index, c.first_block, c.num_blocks, c.key, c.value, c.crc32c
                    )
                )
                continue
            if c.key or c.value:
                raise receiver.failure("a chunk written in place carries bytes in the stream")
            meta = KvChunkMeta(c.layer_index, c.first_block, c.num_blocks, c.crc32c)
            check = asyncio.get_running_loop().run_in_executor(
                CHECKSUM_WORKERS, receiver.crc_in_cache, meta
            )
            # NOTE: the caller stops at the first failed check (a lease that expired fails them
            # all); the others' errors are seen here, not logged as never retrieved.
            check.add_done_callback(_seen)
            checks.append((meta, check))
        elif part == "commit":
            return message.commit, checks
        else:
            raise receiver.failure(f"unexpected {part or 'empty'} message after the header")
    raise receiver.failure("stream ended without a commit", grpc.StatusCode.ABORTED)


def _seen(check: asyncio.Future[int]) -> None:
    if not check.cancelled():
        check.exception()
