"""One stored KV block: its bytes in and out of a `KVCache`, and the checked entry around them.

A *payload* is one full block's KV for every layer, layer by layer, K then V:
``[num_layers, 2, block_size, num_kv_heads, head_dim]`` contiguous in the cache dtype (native
byte order), ``block_payload_nbytes(layout)`` bytes.

An *entry* is what a store keeps under a block key: a fixed 88-byte little-endian header, then
the payload::

    offset  size  field
    0       4     magic b"PDKV"
    4       2     format version (1)
    6       2     reserved (0)
    8       32    KV layout fingerprint (the 64-hex-digit SHA-256, as raw bytes)
    40      32    block key (`prefix_block_keys`)
    72      8     payload length in bytes
    80      4     CRC-32C of the payload (`chunk_crc32c`)
    84      4     reserved (0)

`decode_block` turns anything that is not exactly the expected block into a `BlockMiss` with
its cause: a damaged or foreign entry is a miss, never wrong data.
"""

from __future__ import annotations

import enum
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.kv_cache import KVCache, KVCacheLayout
from pdserve.kv.transfer import chunk_crc32c

MAGIC = b"PDKV"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHH32s32sQI4x")
HEADER_NBYTES = _HEADER.size
KEY_NBYTES = 32


class MissCause(enum.StrEnum):
    """Why a lookup returned no block."""

    MISSING = "missing"
    TRUNCATED = "truncated"
    CORRUPT = "corrupt"
    LAYOUT_MISMATCH = "layout_mismatch"
    KEY_MISMATCH = "key_mismatch"


@dataclass(frozen=True)
class BlockMiss:
    """A lookup that found no usable block, and why."""

    cause: MissCause


def block_payload_nbytes(layout: KVCacheLayout) -> int:
    """Bytes of one block's K and V over all layers (the payload of one entry)."""
    return 2 * layout.num_layers * layout.block_nbytes


def _fingerprint_bytes(fingerprint: str) -> bytes:
    try:
        raw = bytes.fromhex(fingerprint)
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise ValueError(f"a KV layout fingerprint is 64 hex digits, got {fingerprint!r}")
    return raw


def encode_block(fingerprint: str, key: bytes, payload: bytes) -> bytes:
    """The stored entry for one block: header, then the payload.

    Args:
        fingerprint: The KV layout fingerprint (`kv_layout_fingerprint`).
        key: The block's 32-byte key (`prefix_block_keys`).
        payload: The block's KV (`export_block_payloads`).

    Raises:
        ValueError: If the fingerprint or the key has the wrong size.
    """
    if len(key) != KEY_NBYTES:
        raise ValueError(f"a block key is {KEY_NBYTES} bytes, got {len(key)}")
    header = _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        0,
        _fingerprint_bytes(fingerprint),
        key,
        len(payload),
        chunk_crc32c(payload, b""),
    )
    return header + payload


def decode_block(
    blob: bytes | None, expected_fingerprint: str, expected_key: bytes, expected_payload_bytes: int
) -> bytes | BlockMiss:
    """The payload of a stored entry, if it is exactly the block asked for.

    Args:
        blob: The entry as stored, or None when the store had none.
        expected_fingerprint: The reader's KV layout fingerprint.
        expected_key: The key the entry was looked up by.
        expected_payload_bytes: `block_payload_nbytes` of the reader's layout.

    Returns:
        The payload, or a `BlockMiss` naming why the entry is unusable.
    """
    if blob is None:
        return BlockMiss(MissCause.MISSING)
    if len(blob) < HEADER_NBYTES:
        return BlockMiss(MissCause.TRUNCATED)
    magic, version, _, fingerprint, key, payload_len, crc = _HEADER.unpack_from(blob)
    if magic != MAGIC or version != FORMAT_VERSION:
        return BlockMiss(MissCause.CORRUPT)
    if fingerprint != _fingerprint_bytes(expected_fingerprint):
        return BlockMiss(MissCause.LAYOUT_MISMATCH)
    if key != expected_key:
        return BlockMiss(MissCause.KEY_MISMATCH)
    if payload_len != expected_payload_bytes:
        return BlockMiss(MissCause.LAYOUT_MISMATCH)
    if len(blob) < HEADER_NBYTES + payload_len:
        return BlockMiss(MissCause.TRUNCATED)
    payload = blob[HEADER_NBYTES:]
    if len(payload) != payload_len or chunk_crc32c(payload, b"") != crc:
        return BlockMiss(MissCause.CORRUPT)
    return payload


def _blocks_first(kv_cache: KVCache) -> torch.Tensor:
    """A view of the cache indexed by block first (no copy)."""
    # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    return kv_cache.kv.permute(2, 0, 1, 3, 4, 5)


def export_block_payloads(kv_cache: KVCache, block_ids: Sequence[int]) -> list[bytes]:
    """The payloads of the given blocks, in the order given (one gather, one host copy).

    Args:
        kv_cache: The cache to read (CPU or GPU).
        block_ids: Physical block ids.
    """
    if not block_ids:
        return []
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    # blocks: [num_ids, num_layers, 2, block_size, num_kv_heads, head_dim], gathered in one copy
    blocks = _blocks_first(kv_cache)[index]
    raw = blocks.cpu().view(torch.uint8).reshape(len(block_ids), -1).numpy()
    return [row.tobytes() for row in raw]


def import_block_payloads(
    kv_cache: KVCache, block_ids: Sequence[int], payloads: Sequence[bytes]
) -> None:
    """Writes payloads (the layout of `export_block_payloads`) into the given blocks.

    Raises:
        ValueError: If the counts differ or a payload has the wrong size.
    """
    if len(block_ids) != len(payloads):
        raise ValueError(f"{len(block_ids)} block ids but {len(payloads)} payloads")
    if not block_ids:
        return
    nbytes = block_payload_nbytes(kv_cache.layout)
    sizes = {len(p) for p in payloads}
    if sizes != {nbytes}:
        raise ValueError(f"a payload of this layout is {nbytes} bytes, got {sorted(sizes)}")
    joined = b"".join(payloads)
    with warnings.catch_warnings():
        # NOTE: the source is only read; torch warns about read-only buffers regardless.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(joined, dtype=torch.uint8).view(kv_cache.dtype)
    view = _blocks_first(kv_cache)
    # src: [num_ids, num_layers, 2, block_size, num_kv_heads, head_dim]
    src = flat.view(len(block_ids), *view.shape[1:]).to(kv_cache.device)
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    view[index] = src
