"""Both ends of the SyncCache data plane: cutting a sequence's KV into checksummed chunks.

A chunk holds one layer's K and V for a run of the sequence's logical blocks, at most
`max_chunk_bytes` of K+V, so messages stay well under gRPC limits. The CRC-32C covers the K
bytes followed by the V bytes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import google_crc32c

from pdserve.engine.kv_cache import KVCache
from pdserve.v1 import common_pb2, decode_pb2

DEFAULT_MAX_CHUNK_BYTES = 2 << 20


def chunk_crc32c(key: bytes, value: bytes) -> int:
    """CRC-32C of `key` followed by `value`, as KvChunk.crc32c defines it."""
    return int(google_crc32c.extend(google_crc32c.value(key), value))


def layer_chunks(
    kv_cache: KVCache,
    layer_index: int,
    block_ids: Sequence[int],
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> Iterator[decode_pb2.KvChunk]:
    """KvChunk messages for one layer of a sequence whose block table is `block_ids`.

    Args:
        kv_cache: The sender's cache.
        layer_index: Which layer.
        block_ids: The sender's physical blocks, in the sequence's logical order; chunk
            ``first_block`` values index this list (and so the receiver's lease).
        max_chunk_bytes: Upper bound of K+V bytes per chunk (at least one block is sent).
    """
    per_block = 2 * kv_cache.layout.block_nbytes
    blocks_per_chunk = max(1, max_chunk_bytes // per_block)
    for first in range(0, len(block_ids), blocks_per_chunk):
        run = block_ids[first : first + blocks_per_chunk]
        data = kv_cache.export_blocks(layer_index, run)
        # NOTE: protobuf needs bytes; this is the one copy out of the cache.
        key, value = bytes(data.k), bytes(data.v)
        yield decode_pb2.KvChunk(
            layer_index=layer_index,
            first_block=first,
            num_blocks=len(run),
            key=key,
            value=value,
            crc32c=chunk_crc32c(key, value),
        )


def sync_cache_messages(
    kv_cache: KVCache,
    block_ids: Sequence[int],
    header: decode_pb2.SyncCacheHeader,
    first_token_id: int,
    first_token_index: int,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> Iterator[decode_pb2.SyncCacheRequest]:
    """A whole SyncCache stream (header, every layer's chunks, commit) for a computed sequence."""
    yield decode_pb2.SyncCacheRequest(header=header)
    num_chunks = num_bytes = 0
    for layer_index in range(kv_cache.layout.num_layers):
        for chunk in layer_chunks(kv_cache, layer_index, block_ids, max_chunk_bytes):
            num_chunks += 1
            num_bytes += len(chunk.key) + len(chunk.value)
            yield decode_pb2.SyncCacheRequest(chunk=chunk)
    yield decode_pb2.SyncCacheRequest(
        commit=decode_pb2.SyncCacheCommit(
            num_chunks=num_chunks,
            num_bytes=num_bytes,
            first_token_id=first_token_id,
            first_token_index=first_token_index,
        )
    )


def sync_cache_header(
    lease_id: str,
    request_id: str,
    token_ids: Sequence[int],
    num_prompt_tokens: int,
    sampling: common_pb2.SamplingParams,
) -> decode_pb2.SyncCacheHeader:
    """The header message of a transfer."""
    return decode_pb2.SyncCacheHeader(
        lease_id=lease_id,
        request_id=request_id,
        token_ids=list(token_ids),
        num_prompt_tokens=num_prompt_tokens,
        sampling=sampling,
    )
