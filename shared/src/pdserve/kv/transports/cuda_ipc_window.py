"""The prefill's side of the cuda_ipc KV transport: the decodes' caches it mapped, and the
window through which one lease's blocks are written, device to device.

`MappedCaches` opens a decode's `CacheHandle` once and keeps the mapping for later leases; a mapping
whose decode process ended is closed before the next one opens (`close_lost`). A `CacheWindow`
copies a lease's pieces from the prefill's own cache into the lease's blocks of the mapped cache:
layer by layer as the pieces come, on a side stream on CUDA, and `wait` returns once the copies
landed (the chunk messages that announce them go out only then). As with
`pdserve.kv.transports.shm.LeaseWindow`, a piece is addressed by its logical blocks within the
lease, so a write outside the leased blocks cannot be expressed."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import structlog
import torch

from pdserve.common.stale_files import is_process_running
from pdserve.engine.kv_cache import KVCache
from pdserve.kv.transfer import KvPiece, check_lease_blocks, chunk_crc32c, writable_range
from pdserve.kv.transports.cuda_ipc import (
    CacheHandle,
    OpenedCache,
    device_kind,
    host_id,
    open_cache,
)
from pdserve.kv.transports.shm import SHM_DIR

log = structlog.get_logger(__name__)


class CacheWindow:
    """Writes one lease's KV from the sender's cache into its blocks of a mapped cache.

    Args:
        dest: The mapped cache, ``[num_layers, 2, num_blocks, block_size, heads, head_dim]``.
        block_ids: The lease's physical blocks in the mapped cache, in logical order.
        num_shared_blocks: Leading blocks the lease shares with another lease: never written.
        source: The sender's cache; each piece names its blocks there
            (``KvPiece.source_block_ids``), held by the sequence while the transfer runs.
    """

    def __init__(
        self,
        dest: torch.Tensor,
        block_ids: Sequence[int],
        num_shared_blocks: int,
        source: KVCache,
    ) -> None:
        self._dest = dest
        self._block_ids = tuple(block_ids)
        self._num_shared_blocks = num_shared_blocks
        self._source = source.kv
        self._stream: torch.cuda.Stream | None = None
        self._done: torch.cuda.Event | None = None
        if dest.device.type == "cuda":
            # NOTE: a side stream, so that the copies overlap the engine's next layers.
            self._stream = torch.cuda.Stream(device=self._source.device)
            self._done = torch.cuda.Event()

    def write(self, piece: KvPiece, *, corrupt: bool = False) -> int:
        """Queues the copy of `piece`'s blocks (from the sender's cache) into the lease's
        blocks; returns the CRC-32C of its bytes. `wait` says when the copy landed.

        `corrupt` flips one written byte after the copy (fault injection).

        Raises:
            IndexError: The piece's logical blocks are not all within the lease's writable
                blocks, or it does not name its blocks in the sender's cache.
        """
        self.take(piece, corrupt=corrupt)
        return chunk_crc32c(piece.key, piece.value)

    def take(self, piece: KvPiece, *, corrupt: bool = False) -> None:
        """Queues the copy of `piece` as `write` does, without its checksum (a sender that
        checksums a run of pieces as one chunk). Raises as `write`."""
        blocks = writable_range(piece, len(self._block_ids), self._num_shared_blocks)
        source_ids = piece.source_block_ids
        if len(source_ids) != piece.num_blocks:
            raise IndexError(
                f"a piece of {piece.num_blocks} blocks names {len(source_ids)} sources"
            )
        dest_ids = self._block_ids[blocks.start : blocks.stop]
        if self._stream is None:
            self._copy(piece.layer_index, source_ids, dest_ids, corrupt)
        else:
            # NOTE: no wait for the engine's stream: a piece exists only once its layer's blocks
            # were exported (a host copy, which waited for that layer), and nothing writes them
            # again while the sequence holds them; waiting would queue the copy behind the next
            # layers' compute instead of beside it.
            with torch.cuda.stream(self._stream):
                self._copy(piece.layer_index, source_ids, dest_ids, corrupt)

    def wait(self) -> None:
        """Returns once every queued copy is in the mapped cache."""
        if self._stream is not None and self._done is not None:
            self._done.record(self._stream)
            self._done.synchronize()

    def _copy(
        self,
        layer_index: int,
        source_ids: Sequence[int],
        dest_ids: Sequence[int],
        corrupt: bool,
    ) -> None:
        source_index = torch.tensor(source_ids, dtype=torch.long, device=self._source.device)
        dest_index = torch.tensor(dest_ids, dtype=torch.long, device=self._dest.device)
        for kv_index in (0, 1):
            # blocks: [num_blocks, block_size, num_kv_heads, head_dim] of the sender's cache
            blocks = self._source[layer_index, kv_index].index_select(0, source_index)
            self._dest[layer_index, kv_index].index_copy_(
                0, dest_index, blocks.to(self._dest.device, non_blocking=True)
            )
        if corrupt:
            first = self._dest[layer_index, 0, dest_ids[0]].view(-1).view(torch.uint8)
            first[0:1].bitwise_xor_(0xFF)


class MappedCache:
    """A decode's cache mapped into this process, for as long as the decode runs.

    Args:
        handle: What the decode advertised.
        opened: The mapping (`open_cache`).
        directory: Where the stand-in's segment lives.
    """

    def __init__(self, handle: CacheHandle, opened: OpenedCache, directory: Path) -> None:
        self.handle = handle
        self.kv: torch.Tensor | None = opened.kv
        self._keep: object | None = opened.keep
        self._directory = directory

    @property
    def num_blocks(self) -> int:
        """Blocks per layer of the mapped cache."""
        return 0 if self.kv is None else int(self.kv.shape[2])

    def is_alive(self) -> bool:
        """Whether the decode still runs (and, for the stand-in, its segment is there)."""
        if not is_process_running(self.handle.process_id):
            return False
        if self.handle.is_cuda:
            return True
        return (self._directory / self.handle.memory_handle.decode()).exists()

    def window(
        self,
        block_ids: Sequence[int],
        num_shared_blocks: int,
        source: KVCache,
    ) -> CacheWindow:
        """The writer of one lease's blocks from `source` (`CacheWindow` says the arguments).

        Raises:
            ValueError: The mapping is closed, or a block id is outside the mapped cache.
        """
        if self.kv is None:
            raise ValueError("the mapping is closed")
        check_lease_blocks(block_ids, self.num_blocks, "the cache")
        return CacheWindow(self.kv, block_ids, num_shared_blocks, source)

    def close(self) -> None:
        """Drops the mapping (unmapped once no window uses it any more)."""
        self.kv = None
        self._keep = None


class MappedCaches:
    """The decodes' caches this prefill mapped, one per decode, and the rule for using one.

    Args:
        source: The prefill's own cache (what windows copy from).
        directory: Where the stand-in's segments live.
    """

    def __init__(self, source: KVCache, directory: Path = SHM_DIR) -> None:
        self.source = source
        self.directory = directory
        self.host_id = host_id()
        self.device_kind = device_kind(source.device)
        self._caches: dict[tuple[int, bytes], MappedCache] = {}

    def can_map(self, handle: CacheHandle) -> bool:
        """Whether `handle` is worth trying: its decode shares this host and device kind."""
        return handle.host_id == self.host_id and handle.device_kind == self.device_kind

    def open(self, handle: CacheHandle) -> MappedCache:
        """The mapping of `handle`'s cache (opened on first use; lost decodes' are closed).

        Raises:
            CacheUnavailable: As `open_cache`.
        """
        key = (handle.process_id, handle.memory_handle)
        cache = self._caches.get(key)
        if cache is not None and cache.handle == handle:
            return cache
        self.close_lost()
        cache = self._caches[key] = MappedCache(
            handle, open_cache(handle, self.source.layout, self.directory), self.directory
        )
        log.info(
            "kv_cache_mapped",
            device_kind=handle.device_kind,
            process_id=handle.process_id,
            num_blocks=cache.num_blocks,
        )
        return cache

    def close_lost(self) -> int:
        """Closes the mappings whose decode stopped; returns how many."""
        lost = [key for key, cache in self._caches.items() if not cache.is_alive()]
        for key in lost:
            cache = self._caches.pop(key)
            cache.close()
            log.info("kv_cache_unmapped", process_id=cache.handle.process_id)
        return len(lost)

    def __len__(self) -> int:
        return len(self._caches)
