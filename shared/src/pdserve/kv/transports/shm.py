"""The shared-memory KV transport's segment: a decode's KV cache in a named file under
/dev/shm that a prefill on the same host writes into directly.

The decode places its whole cache in a segment (`KvSegment.create`): the file is created
exclusively with mode 0600 (only the decode's user can open it), its name carries 128 random
bits (it is only ever sent inside Lease messages, over the authenticated plane), and its pages
are allocated up front, so a full /dev/shm fails here rather than as a SIGBUS in a writer.
The layout is the cache's own: ``[layer][K, V][physical block][block bytes]``; a cache whose
sliding-window layers keep only their window holds the other layers so, followed by
``[sliding layer][K, V][slot][block bytes]`` (the lease names its blocks' slots).

A prefill maps the segment once per decode (`SharedKvPool`) and writes a lease's KV through a
`LeaseWindow`, which knows only that lease's block ids: a piece is addressed by its logical
blocks within the lease, so a write outside the leased blocks cannot be expressed. (Any process
of the same user can also read or write the decode's memory directly, so the file mode is the
boundary between users; the window is the boundary between leases.)
"""

from __future__ import annotations

import mmap
import os
import secrets
import stat
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import structlog

from pdserve.common.stale_files import remove_orphaned_files
from pdserve.engine.kv_cache import KVCache, KVCacheLayout, id_runs, layer_storage
from pdserve.kv.transfer import KvPiece, check_lease_blocks, chunk_crc32c, writable_range

log = structlog.get_logger(__name__)

SHM_DIR = Path("/dev/shm")
NAME_PREFIX = "pdserve-kv-"


class KvSegment:
    """A decode's KV cache placed in a shared-memory file (decode side).

    Args:
        path: The segment's file.
        mapping: Its mapping (backs the cache tensor; stays open while the process lives).
    """

    def __init__(self, path: Path, mapping: mmap.mmap) -> None:
        self.path = path
        self.mapping = mapping

    @property
    def name(self) -> str:
        """What a Lease's shared-memory transport carries as its address."""
        return self.path.name

    @classmethod
    def create(
        cls, kv_cache: KVCache, directory: Path = SHM_DIR, *, is_empty: bool = False
    ) -> KvSegment:
        """Creates a segment of the cache's size and moves `kv_cache` into it (or, for a cache
        already in a shared file, names that file). `is_empty`: no block of the cache was
        handed out yet, so nothing is copied (the new file's pages read as zeros).

        Raises:
            OSError: The segment cannot be created or its pages allocated (e.g. /dev/shm full).
            ValueError: The cache is not on CPU.
        """
        remove_stale_segments(directory)
        path = directory / f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(16)}"
        if kv_cache.shared_path is not None:
            return cls._link(kv_cache, kv_cache.shared_path, path)
        mapping = _allocate_and_map(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, kv_cache.nbytes)
        try:
            kv_cache.place_in(memoryview(mapping), keep_contents=not is_empty)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        log.info("kv_segment_created", name=path.name, num_bytes=kv_cache.nbytes)
        return cls(path, mapping)

    @classmethod
    def _link(cls, kv_cache: KVCache, shared_path: Path, path: Path) -> KvSegment:
        """The segment of a cache already in a shared file (a tensor-parallel instance's, whose
        ranks map it): a second name for the same file, its pages allocated now."""
        os.link(shared_path, path)
        mapping = _allocate_and_map(path, os.O_RDWR, kv_cache.nbytes)
        log.info("kv_segment_created", name=path.name, num_bytes=kv_cache.nbytes, linked=True)
        return cls(path, mapping)

    def remove(self) -> None:
        """Removes the file (the cache keeps its memory; writers that mapped it keep theirs)."""
        self.path.unlink(missing_ok=True)


def _allocate_and_map(path: Path, flags: int, num_bytes: int) -> mmap.mmap:
    """Opens `path` with `flags`, allocates `num_bytes` of pages now (a full /dev/shm fails
    here, not with SIGBUS later) and maps them shared; removes `path` if that fails."""
    fd = os.open(path, flags, 0o600)
    try:
        os.posix_fallocate(fd, 0, num_bytes)
        return mmap.mmap(fd, num_bytes, mmap.MAP_SHARED)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)


def remove_stale_segments(directory: Path = SHM_DIR) -> int:
    """Removes this user's segments left by decode processes that no longer run; returns how
    many."""
    return remove_orphaned_files(directory, NAME_PREFIX)


class SharedKvPool:
    """A decode's segment mapped into a prefill (sender side).

    Args:
        name: The segment name from the lease's shared-memory transport.
        layout: The KV layout (both ends' fingerprints are equal).
        directory: Where segments live.
        window_layers: The model's sliding-window layers, if the decode keeps them in window
            storage of `num_window_slots` slots (``Lease.num_window_slots``).
        num_window_slots: That storage's slots; 0: every layer's blocks, as a plain cache.

    Raises:
        OSError: No such segment here (the decode is on another host), or it cannot be mapped.
        PermissionError: The file is not this user's or other users may open it.
        ValueError: The name is not a segment name, or its size does not fit the layout.
    """

    def __init__(
        self,
        name: str,
        layout: KVCacheLayout,
        directory: Path = SHM_DIR,
        window_layers: Sequence[int] = (),
        num_window_slots: int = 0,
    ) -> None:
        if not name.startswith(NAME_PREFIX) or "/" in name or name in (".", ".."):
            raise ValueError(f"not a KV segment name: {name!r}")
        self.name = name
        self.path = directory / name
        self.block_nbytes = layout.block_nbytes
        window_layers = tuple(window_layers) if num_window_slots else ()
        self.num_window_slots = num_window_slots
        num_full = layout.num_layers - len(window_layers)
        fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            info = os.fstat(fd)
            if info.st_uid != os.getuid() or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise PermissionError(f"{name} is not private to this user")
            per_block = 2 * layout.block_nbytes
            window_bytes = len(window_layers) * num_window_slots * per_block
            blocks_bytes = info.st_size - window_bytes
            if info.st_size == 0 or blocks_bytes < 0 or blocks_bytes % (num_full * per_block or 1):
                raise ValueError(f"{name} holds {info.st_size} bytes, not whole KV blocks")
            self.num_blocks = blocks_bytes // (num_full * per_block) if num_full else 0
            # NOTE: mapped lazily: a block's pages are mapped on the first write into it (a few
            # ms for a lease of 5.5 MB, once). Populating the whole segment here cost 0.8-1.6 s
            # on a decode's 2 GB cache, on the first request's path (its TTFT), to map pages
            # most leases never touch.
            self.mapping = mmap.mmap(fd, info.st_size, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        data = np.frombuffer(self.mapping, dtype=np.uint8)
        # blocks: [num_full_layers, 2, num_blocks, block_nbytes] bytes of the decode's cache;
        # slots: [len(window_layers), 2, num_window_slots, block_nbytes] after them
        self.blocks = data[:blocks_bytes].reshape(num_full, 2, self.num_blocks, layout.block_nbytes)
        self.slots = data[blocks_bytes:].reshape(
            len(window_layers), 2, num_window_slots, layout.block_nbytes
        )
        self.storage = layer_storage(layout.num_layers, window_layers)
        """Each layer's storage: (in ``slots`` rather than ``blocks``, index there)."""

    def exists(self) -> bool:
        """Whether the segment's file is still there (its decode still runs)."""
        return self.path.exists()

    def window(
        self,
        block_ids: Sequence[int],
        num_shared_blocks: int = 0,
        num_window_skipped: int = 0,
        window_slot_ids: Sequence[int] = (),
    ) -> LeaseWindow:
        """The writer of one lease's blocks (the first `num_shared_blocks` of them, which the
        lease shares with another, read-only); with window storage, a sliding layer's blocks
        from `num_window_skipped` on go to `window_slot_ids`, and the ones before to nowhere.

        Raises:
            ValueError: A block id or slot outside the segment, or slots that do not match
                the lease's blocks.
        """
        if self.blocks.shape[0]:
            check_lease_blocks(block_ids, self.num_blocks, self.name)
        if self.slots.shape[0]:
            if len(window_slot_ids) != max(0, len(block_ids) - num_window_skipped):
                raise ValueError(
                    f"{len(window_slot_ids)} window slots for the lease's "
                    f"{len(block_ids) - num_window_skipped} blocks in the window"
                )
            check_lease_blocks(window_slot_ids, self.num_window_slots, f"{self.name}'s slots")
        return LeaseWindow(
            self,
            tuple(block_ids),
            num_shared_blocks,
            num_window_skipped,
            tuple(window_slot_ids),
        )


class LeaseWindow:
    """Writes one lease's KV into its blocks of a `SharedKvPool`, and nowhere else.

    Args:
        pool: The mapped segment.
        block_ids: The lease's physical blocks, in the sequence's logical order.
        num_shared_blocks: Leading blocks the lease shares with another lease: never written.
        num_window_skipped: Leading blocks without the sliding layers' KV (window storage).
        window_slot_ids: The slots of the blocks after those, for the sliding layers.
    """

    def __init__(
        self,
        pool: SharedKvPool,
        block_ids: tuple[int, ...],
        num_shared_blocks: int = 0,
        num_window_skipped: int = 0,
        window_slot_ids: tuple[int, ...] = (),
    ) -> None:
        self._pool = pool
        self._block_nbytes = pool.block_nbytes
        self._block_ids = block_ids
        self._num_shared_blocks = num_shared_blocks
        self._num_window_skipped = num_window_skipped
        self._window_slot_ids = window_slot_ids

    def write(self, piece: KvPiece, *, corrupt: bool = False) -> int:
        """Copies `piece` into the lease's blocks; returns the CRC-32C of what it meant to write.

        `corrupt` flips one written byte after the copy (fault injection).

        Raises:
            IndexError: The piece's logical blocks are not all within the lease's writable
                blocks (of its layer).
        """
        self.take(piece, corrupt=corrupt)
        return chunk_crc32c(piece.key, piece.value)

    def take(self, piece: KvPiece, *, corrupt: bool = False) -> None:
        """Copies `piece` into the lease's blocks as `write` does, without its checksum (a
        sender that checksums a run of pieces as one chunk). Raises as `write`."""
        is_window, index = self._pool.storage[piece.layer_index]
        if is_window:
            # NOTE: a sliding layer's blocks a window behind have no storage at all.
            skipped = self._num_window_skipped
            blocks = writable_range(
                piece, len(self._block_ids), max(self._num_shared_blocks, skipped)
            )
            targets = self._window_slot_ids[blocks.start - skipped : blocks.stop - skipped]
            storage = self._pool.slots[index]
        else:
            blocks = writable_range(piece, len(self._block_ids), self._num_shared_blocks)
            targets = self._block_ids[blocks.start : blocks.stop]
            storage = self._pool.blocks[index]
        for kv_index, data in ((0, piece.key), (1, piece.value)):
            # source: [num_blocks, block_nbytes] bytes of the sender's cache
            source = np.frombuffer(data, dtype=np.uint8).reshape(-1, self._block_nbytes)
            offset = 0
            for start, stop in id_runs(targets):
                count = stop - start
                storage[kv_index, start:stop] = source[offset : offset + count]
                offset += count
        if corrupt:
            storage[0, targets[0], 0] ^= 0xFF
