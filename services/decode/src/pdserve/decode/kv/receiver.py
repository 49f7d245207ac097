"""Receives one KV transfer into a request's leased blocks and verifies it completely.

The chunks arrive three ways: as bytes in the SyncCache stream (`receive`), read from the TCP
data port straight into the leased blocks (`fill`; a cache in device memory through host
staging buffers, `pdserve.kv.staging`), or already written into the blocks by a sender sharing
the cache's memory; the last two are accepted by `receive_written` with their
checksum in the cache (`crc_in_cache`, which `CHECKSUM_WORKERS` may compute in parallel).
Whatever the way, a transfer is accepted only if every chunk lies inside the lease, the CRC-32C
of what is in the cache matches the sender's, the commit's chunk count and byte total equal
what arrived, and every (layer, block) the prompt needs was written. A lease that shares its
leading blocks with another lease (`block_sharing`) has them already: they count as written,
a chunk into them is refused (another lease reads them), and the header's tokens must be the
ones they hold. On a cache whose sliding layers keep only their window, those layers' leading
blocks the lease skipped (``Lease.num_window_skipped_blocks``) count as written too, and a
chunk into them is refused. Anything else is CACHE_SYNC_FAILED; the caller then frees the
lease.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import grpc

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import num_blocks_for
from pdserve.decode.block_sharing import prefix_mismatch
from pdserve.decode.lease_state import RequestStatus
from pdserve.decode.request import DecodeRequest
from pdserve.engine.kv_cache import KVCache, id_runs
from pdserve.kv.staging import HostStaging, StagedChunk
from pdserve.kv.transfer import blocks_crc32c, chunk_crc32c

# Checksums over the cache are independent reads that release the GIL: a few threads share them.
CHECKSUM_WORKERS = ThreadPoolExecutor(
    max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="kv-checksum"
)

# Fills a view of the cache with the next bytes of a transfer (the TCP port's recv_into loop).
Filler = Callable[[memoryview], None]


class KvChunkMeta(NamedTuple):
    """Where a chunk goes and its checksum, without its bytes."""

    layer_index: int
    first_block: int
    num_blocks: int
    crc32c: int


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
        staging: The host staging `fill` reads through (made for a cache not on CPU).
    """

    def __init__(
        self, kv_cache: KVCache, request: DecodeRequest, staging: HostStaging | None = None
    ) -> None:
        self.kv_cache = kv_cache
        self.request = request
        # NOTE: `fill` reads through host buffers into a cache the socket cannot reach (CUDA);
        # tests pass one to run those steps on CPU.
        self.staging = staging
        if staging is None and kv_cache.device.type != "cpu":
            self.staging = HostStaging(kv_cache)
        self._staged: dict[KvChunkMeta, list[StagedChunk]] = {}
        self.num_layers = kv_cache.layout.num_layers
        self.num_blocks = num_blocks_for(request.num_kv_tokens, kv_cache.block_size)
        self.num_chunks = 0
        self.num_bytes = 0
        self.num_shared_blocks = request.num_shared_blocks
        # NOTE: a sliding-window layer's leading blocks the lease skips (window slots) are
        # neither sent nor written.
        self.window_layers = frozenset(kv_cache.window_layers)
        self.num_window_skipped = min(request.num_window_released, self.num_blocks)
        # NOTE: one flag per (layer, logical block) proves the cache is complete at commit;
        # the shared blocks (and the skipped ones) are complete already.
        row = b"\x01" * self.num_shared_blocks + bytes(self.num_blocks - self.num_shared_blocks)
        skipped = b"\x01" * max(self.num_shared_blocks, self.num_window_skipped)
        window_row = skipped + row[len(skipped) :]
        self._written = bytearray(
            b"".join(
                window_row if layer in self.window_layers else row
                for layer in range(self.num_layers)
            )
        )

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

    def check_header(self, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """Checks that the header's tokens are the ones the lease was granted for (and, over
        its shared blocks, the ones those blocks hold).

        Raises:
            PdserveError: CACHE_SYNC_FAILED if they are not.
        """
        num_tokens = len(token_ids)
        if num_tokens != self.request.num_kv_tokens or num_prompt_tokens > num_tokens:
            raise self.failure(
                f"header carries {num_tokens} tokens (prompt {num_prompt_tokens}), "
                f"the lease was granted for {self.request.num_kv_tokens}"
            )
        mismatch = prefix_mismatch(self.request.shared_token_ids, token_ids)
        if mismatch is not None:
            raise self.failure(mismatch)

    def receive(self, chunk: KvChunkData) -> None:
        """Verifies and writes one chunk of the SyncCache stream.

        Raises:
            PdserveError: CACHE_SYNC_FAILED for a bad checksum, range or size.
        """
        if chunk_crc32c(chunk.key, chunk.value) != chunk.crc32c:
            raise self.failure(
                f"checksum mismatch in chunk {self.num_chunks} (layer {chunk.layer_index})"
            )
        meta = KvChunkMeta(chunk.layer_index, chunk.first_block, chunk.num_blocks, chunk.crc32c)
        block_ids = self._leased_blocks(meta)
        try:
            self.kv_cache.import_blocks(chunk.layer_index, block_ids, chunk.key, chunk.value)
        except ValueError as error:
            raise self.failure(str(error)) from None
        self._count(meta)

    def fill(self, meta: KvChunkMeta, fill: Filler) -> None:
        """Reads one chunk straight into its leased blocks with `fill` (K of every block, then
        V); `receive_written` accepts it once its checksum in the cache is known.

        Raises:
            PdserveError: CACHE_SYNC_FAILED for a chunk outside the lease.
        """
        block_ids = self._leased_blocks(meta)
        if self.staging is not None:
            staged = self.staging.fill(meta.layer_index, block_ids, fill)
            self._staged.setdefault(meta, []).append(staged)
            return
        block_ids = self.kv_cache.physical_blocks(meta.layer_index, block_ids)
        k_cache, v_cache = self.kv_cache.layer(meta.layer_index)
        for cache in (k_cache, v_cache):
            for start, stop in id_runs(block_ids):
                fill(self.kv_cache.block_bytes(cache, start, stop))

    def crc_in_cache(self, meta: KvChunkMeta) -> int:
        """The CRC-32C of chunk `meta`'s blocks as they are in the cache now (read only: safe
        to run for several chunks at once on worker threads).

        Raises:
            PdserveError: CACHE_SYNC_FAILED for a chunk outside the lease.
        """
        for staged in self._staged.get(meta, ()):
            staged.wait()  # NOTE: a staged chunk is checksummed once its copy landed
        return blocks_crc32c(self.kv_cache, meta.layer_index, self._leased_blocks(meta))

    def receive_written(self, meta: KvChunkMeta, crc_in_cache: int) -> None:
        """Accepts one chunk already in the leased blocks (written by a sender sharing the
        cache, or by `fill`) if `crc_in_cache` (`crc_in_cache(meta)`) is the sender's checksum.

        Raises:
            PdserveError: CACHE_SYNC_FAILED for a bad checksum.
        """
        self._check_crc(meta, crc_in_cache)

    def check_open(self) -> None:
        """Raises unless the lease is still SYNCING: LEASE_EXPIRED if it expired meanwhile,
        else CACHE_SYNC_FAILED."""
        status = self.request.status
        if status is RequestStatus.EXPIRED:
            raise PdserveError(
                ErrorReason.LEASE_EXPIRED,
                "the lease expired during the transfer",
                {"leaseId": self.request.lease_id, "requestId": self.request.request_id},
            )
        if status is not RequestStatus.SYNCING:
            raise self.failure(f"the lease ended during the transfer ({status.name})")

    def _leased_blocks(self, meta: KvChunkMeta) -> list[int]:
        self.check_open()
        if not 0 <= meta.layer_index < self.num_layers:
            raise self.failure(f"layer {meta.layer_index} out of range 0..{self.num_layers - 1}")
        end = meta.first_block + meta.num_blocks
        if meta.num_blocks <= 0 or meta.first_block < 0 or end > self.num_blocks:
            raise self.failure(
                f"blocks {meta.first_block}..{end - 1} outside the lease's {self.num_blocks}"
            )
        if meta.first_block < self.num_shared_blocks:
            # NOTE: another lease reads these blocks: nothing may write into them.
            raise self.failure(
                f"blocks {meta.first_block}..{end - 1} include the lease's "
                f"{self.num_shared_blocks} shared blocks"
            )
        if meta.layer_index in self.window_layers and meta.first_block < self.num_window_skipped:
            # NOTE: no window slot backs them: the lease skipped them for sliding layers.
            raise self.failure(
                f"blocks {meta.first_block}..{end - 1} of sliding layer {meta.layer_index} "
                f"include the lease's {self.num_window_skipped} blocks a window behind"
            )
        return self.request.block_ids[meta.first_block : end]

    def _check_crc(self, meta: KvChunkMeta, crc_in_cache: int) -> None:
        if crc_in_cache != meta.crc32c:
            raise self.failure(
                f"checksum mismatch in chunk {self.num_chunks} (layer {meta.layer_index})"
            )
        self._count(meta)

    def _count(self, meta: KvChunkMeta) -> None:
        row = meta.layer_index * self.num_blocks
        start = row + meta.first_block
        self._written[start : start + meta.num_blocks] = b"\x01" * meta.num_blocks
        self.num_chunks += 1
        self.num_bytes += 2 * meta.num_blocks * self.kv_cache.layout.block_nbytes

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
