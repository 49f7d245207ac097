"""The KV data plane's rules, for both ends: how KV is cut into chunks and checksummed.

A chunk holds one layer's K and V for a run of a sequence's logical blocks, at most
`max_chunk_bytes` of K+V (at least one block), so messages stay well under gRPC limits. The
CRC-32C covers the K bytes followed by the V bytes.

The prefill cuts its KV with `layer_pieces` (on its engine thread, as each layer is computed)
and `pdserve.prefill.kv.sender` ships the pieces over one of the transports; the decode checks
every chunk with `chunk_crc32c` (bytes it received) or `blocks_crc32c` (bytes already in its
cache). An in-place writer (shared memory, CUDA IPC, NIXL) addresses a piece by its logical
blocks within the lease and checks them with `writable_range` before it writes. No protobuf
here: the engine thread imports this module.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from fastcrc import crc32

from pdserve.engine.kv_cache import KVBlockData, KVCache, KVCacheLayout, id_runs
from pdserve.kv.staging import export_to_host


@dataclass(frozen=True)
class KvPiece:
    """One layer's K and V for a run of a sequence's logical blocks, ready to ship.

    ``key`` and ``value`` may alias the sender's KV cache: they stay valid while the sequence
    holds its blocks. ``source_block_ids`` are those blocks in the sender's cache (what a
    device-to-device copy reads; empty where the piece was not cut from a cache).
    """

    layer_index: int
    first_block: int
    num_blocks: int
    key: memoryview
    value: memoryview
    source_block_ids: tuple[int, ...] = ()


_Buffer = bytes | bytearray | memoryview

# The initial metadata a decode sends on SyncCache once it accepted the header's token; a
# shared-memory sender writes into the segment only after it.
SYNC_ACCEPTED_KEY = "pdserve-sync-accepted"


def chunk_crc32c(key: _Buffer, value: _Buffer) -> int:
    """CRC-32C of `key` followed by `value`, as KvChunk.crc32c defines it (any buffer, no
    copy; the GIL is released for large ones)."""
    return int(crc32.iscsi(value, crc32.iscsi(key)))


def chunk_runs(pieces: Sequence[KvPiece]) -> list[list[KvPiece]]:
    """`pieces` in order, cut into the runs an in-place sender announces as one chunk each:
    consecutive pieces of one layer whose logical blocks follow each other. A chunk's bytes
    are already in the decode's cache, so its size bounds no message: fewer, larger chunks are
    fewer messages and fewer checksum tasks at both ends (`run_crc32c` is a run's checksum)."""
    runs: list[list[KvPiece]] = []
    for piece in pieces:
        if runs:
            last = runs[-1][-1]
            if (
                piece.layer_index == last.layer_index
                and piece.first_block == last.first_block + last.num_blocks
            ):
                runs[-1].append(piece)
                continue
        runs.append([piece])
    return runs


def run_crc32c(run: Sequence[KvPiece]) -> int:
    """The chunk CRC-32C of a run of `chunk_runs` announced as one chunk: the K of every piece
    in order, then the V of every piece (what `blocks_crc32c` computes over the run's blocks)."""
    crc = 0
    for part in [piece.key for piece in run] + [piece.value for piece in run]:
        crc = crc32.iscsi(part, crc)
    return int(crc)


def blocks_crc32c(kv_cache: KVCache, layer_index: int, block_ids: Sequence[int]) -> int:
    """The chunk CRC-32C of blocks already in `kv_cache`: K of `block_ids` in order, then V,
    computed on the cache itself (runs of consecutive ids are not copied), or on a host copy
    of each run for a cache in device memory."""
    block_ids = kv_cache.physical_blocks(layer_index, block_ids)
    k_cache, v_cache = kv_cache.layer(layer_index)
    crc = 0
    for cache in (k_cache, v_cache):
        for start, stop in id_runs(block_ids):
            if cache.device.type == "cpu":
                data = kv_cache.block_bytes(cache, start, stop)
            else:
                data = kv_cache.block_bytes(cache[start:stop].cpu(), 0, stop - start)
            crc = crc32.iscsi(data, crc)
    return int(crc)


def writable_range(piece: KvPiece, num_leased: int, num_unwritable: int) -> range:
    """The logical blocks of a lease that `piece` writes: the check every in-place writer
    (shared memory, CUDA IPC, NIXL) makes before it touches the decode's cache.

    Args:
        piece: What is to be written.
        num_leased: The lease's blocks.
        num_unwritable: Its leading blocks the piece's layer may not write: those shared with
            another lease (read-only), or for a sliding-window layer those a window behind
            (no storage on a decode that keeps only the window), whichever are more.

    Raises:
        IndexError: The piece's blocks are not all within the lease's writable blocks.
    """
    end = piece.first_block + piece.num_blocks
    if piece.first_block < 0 or end > num_leased or piece.num_blocks <= 0:
        raise IndexError(f"blocks {piece.first_block}..{end - 1} outside the lease's {num_leased}")
    if piece.first_block < num_unwritable:
        raise IndexError(
            f"blocks {piece.first_block}..{end - 1} of layer {piece.layer_index} include the "
            f"lease's {num_unwritable} leading blocks not written (shared with another lease, "
            "or a sliding layer's a window behind)"
        )
    return range(piece.first_block, end)


def check_lease_blocks(block_ids: Sequence[int], num_blocks: int, cache: str) -> None:
    """Raises ValueError unless every id of `block_ids` is one of the `num_blocks` blocks of
    the decode's cache named `cache` (a writer is opened only on a lease inside it)."""
    if any(not 0 <= b < num_blocks for b in block_ids):
        raise ValueError(f"lease blocks outside the {num_blocks} blocks of {cache}")


def blocks_per_piece(layout: KVCacheLayout, max_chunk_bytes: int) -> int:
    """Most blocks of one layer whose K+V fit in `max_chunk_bytes` (at least one)."""
    return max(1, max_chunk_bytes // (2 * layout.block_nbytes))


def layer_pieces(
    kv_cache: KVCache,
    layer_index: int,
    block_ids: Sequence[int],
    num_blocks_per_piece: int,
    first_block: int = 0,
    end_block: int | None = None,
) -> Iterator[KvPiece]:
    """One layer of the logical blocks [first_block, end_block) of a sequence, in pieces.

    Args:
        kv_cache: The sender's cache.
        layer_index: Which layer.
        block_ids: The sender's physical blocks, in the sequence's logical order; a piece's
            ``first_block`` indexes this list (and so the receiver's lease).
        num_blocks_per_piece: Most blocks per piece (`blocks_per_piece`).
        first_block: First logical block to export.
        end_block: One past the last logical block (default: the whole block table).
    """
    end = len(block_ids) if end_block is None else end_block
    starts = range(first_block, end, num_blocks_per_piece)
    runs = [tuple(block_ids[start : min(end, start + num_blocks_per_piece)]) for start in starts]
    datas: Iterable[KVBlockData]
    if kv_cache.device.type == "cuda":
        # NOTE: pinned host buffers, every piece of the layer queued before one wait.
        datas = export_to_host(kv_cache, layer_index, runs)
    else:
        datas = (kv_cache.export_blocks(layer_index, run) for run in runs)
    for start, run, data in zip(starts, runs, datas, strict=True):
        yield KvPiece(layer_index, start, len(run), data.k, data.v, run)


def sequence_pieces(
    kv_cache: KVCache,
    block_ids: Sequence[int],
    max_chunk_bytes: int,
    first_block: int = 0,
    window_layers: frozenset[int] = frozenset(),
    first_window_block: int = 0,
) -> Iterator[KvPiece]:
    """Every layer's pieces of a whole computed sequence from logical block `first_block` on
    (the receiver holds those before it), layer by layer: what the prefill exports for a
    prompt computed in one pass. The layers of `window_layers` start at `first_window_block`
    if that is later (a receiver that keeps only their window skips the blocks before)."""
    num_blocks_per_piece = blocks_per_piece(kv_cache.layout, max_chunk_bytes)
    for layer_index in range(kv_cache.layout.num_layers):
        first = first_block
        if layer_index in window_layers:
            first = max(first, first_window_block)
        yield from layer_pieces(kv_cache, layer_index, block_ids, num_blocks_per_piece, first)
