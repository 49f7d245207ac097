"""Receives one SyncCache transfer into a request's leased blocks and verifies it completely.

A transfer is accepted only if every chunk's CRC-32C matches, every chunk lands inside the
lease, the commit's chunk count and byte total equal what arrived, and every (layer, block) the
prompt needs was written. Anything else is CACHE_SYNC_FAILED; the caller then frees the lease.
"""

from __future__ import annotations

from typing import NamedTuple

import grpc

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import num_blocks_for
from pdserve.decode.request import DecodeRequest
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
    """Writes the chunks of one transfer into `request`'s blocks of `kv_cache`.

    Args:
        kv_cache: The decode's KV cache.
        request: The SYNCING request being filled (its block table is fixed meanwhile).
    """

    def __init__(self, kv_cache: KVCache, request: DecodeRequest) -> None:
        self.kv_cache = kv_cache
        self.request = request
        self.num_layers = kv_cache.layout.num_layers
        self.num_blocks = num_blocks_for(request.num_kv_tokens, kv_cache.block_size)
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
            {"leaseId": self.request.lease_id, "requestId": self.request.request_id},
            code=code,
        )

    def check_header(self, num_tokens: int, num_prompt_tokens: int) -> None:
        """Checks that the header's tokens are the ones the lease was granted for.

        Raises:
            PdserveError: CACHE_SYNC_FAILED if they are not.
        """
        if num_tokens != self.request.num_kv_tokens or num_prompt_tokens > num_tokens:
            raise self.failure(
                f"header carries {num_tokens} tokens (prompt {num_prompt_tokens}), "
                f"the lease was granted for {self.request.num_kv_tokens}"
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
        block_ids = self.request.block_ids[chunk.first_block : end]
        try:
            self.kv_cache.import_blocks(chunk.layer_index, block_ids, chunk.key, chunk.value)
        except ValueError as error:
            raise self.failure(str(error)) from None
        row = chunk.layer_index * self.num_blocks
        self._written[row + chunk.first_block : row + end] = b"\x01" * chunk.num_blocks
        self.num_chunks += 1
        self.num_bytes += len(chunk.key) + len(chunk.value)

    def commit(
        self, num_chunks: int, num_bytes: int, first_token_index: int, expected_index: int
    ) -> None:
        """Checks the commit's counts and first-token index, and that every needed block of
        every layer arrived.

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
        if first_token_index != expected_index:
            raise self.failure(f"first_token_index {first_token_index}, expected {expected_index}")
