"""Receives one SyncCache transfer into a lease's blocks and verifies it completely.

A transfer is accepted only if every chunk's CRC-32C matches, every chunk lands inside the
lease, the commit's chunk count and byte total equal what arrived, and every (layer, block) the
prompt needs was written. Anything else is CACHE_SYNC_FAILED; the caller then frees the lease.
"""

from __future__ import annotations

from typing import NamedTuple

import grpc

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import num_blocks_for
from pdserve.decode.leases import Lease
from pdserve.engine.kv_cache import KVCache
from pdserve.serving.kv_transfer import chunk_crc32c


class KvChunkData(NamedTuple):
    """One chunk of a transfer (the KvChunk message without protobuf)."""

    layer_index: int
    first_block: int
    num_blocks: int
    key: bytes
    value: bytes
    crc32c: int


class KvReceiver:
    """Writes the chunks of one transfer into `lease`'s blocks of `kv_cache`.

    Args:
        kv_cache: The decode's KV cache.
        lease: The lease being filled (its block table is fixed during the transfer).
    """

    def __init__(self, kv_cache: KVCache, lease: Lease) -> None:
        self.kv_cache = kv_cache
        self.lease = lease
        self.num_layers = kv_cache.layout.num_layers
        self.num_blocks = num_blocks_for(lease.num_prompt_tokens, kv_cache.block_size)
        self.num_chunks = 0
        self.num_bytes = 0
        # NOTE: one flag per (layer, logical block) proves the cache is complete at commit.
        self._written = bytearray(self.num_layers * self.num_blocks)

    def failure(
        self, message: str, code: grpc.StatusCode = grpc.StatusCode.DATA_LOSS
    ) -> PdserveError:
        """The CACHE_SYNC_FAILED error for this transfer."""
        return PdserveError(
            ErrorReason.CACHE_SYNC_FAILED,
            message,
            {"leaseId": self.lease.lease_id, "requestId": self.lease.request_id},
            code=code,
        )

    def receive(self, chunk: KvChunkData) -> None:
        """Verifies and writes one chunk.

        Raises:
            PdserveError: CACHE_SYNC_FAILED for a bad checksum, range or size.
        """
        if chunk_crc32c(chunk.key, chunk.value) != chunk.crc32c:
            raise self.failure(
                f"checksum mismatch in chunk {self.num_chunks} (layer {chunk.layer_index})"
            )
        if not 0 <= chunk.layer_index < self.num_layers:
            raise self.failure(f"layer {chunk.layer_index} out of range 0..{self.num_layers - 1}")
        end = chunk.first_block + chunk.num_blocks
        if chunk.num_blocks <= 0 or end > self.num_blocks:
            raise self.failure(
                f"blocks {chunk.first_block}..{end - 1} outside the lease's {self.num_blocks}"
            )
        block_ids = self.lease.block_ids[chunk.first_block : end]
        try:
            self.kv_cache.import_blocks(chunk.layer_index, block_ids, chunk.key, chunk.value)
        except ValueError as error:
            raise self.failure(str(error)) from None
        row = chunk.layer_index * self.num_blocks
        self._written[row + chunk.first_block : row + end] = b"\x01" * chunk.num_blocks
        self.num_chunks += 1
        self.num_bytes += len(chunk.key) + len(chunk.value)

    def commit(self, num_chunks: int, num_bytes: int) -> None:
        """Checks the commit's counts and that every needed block of every layer arrived.

        Raises:
            PdserveError: CACHE_SYNC_FAILED for a short or inconsistent transfer.
        """
        if (num_chunks, num_bytes) != (self.num_chunks, self.num_bytes):
            raise self.failure(
                f"commit announces {num_chunks} chunks / {num_bytes} bytes, received "
                f"{self.num_chunks} / {self.num_bytes}"
            )
        missing = self._written.count(0)
        if missing:
            raise self.failure(f"{missing} (layer, block) pairs of the prompt's KV never arrived")
