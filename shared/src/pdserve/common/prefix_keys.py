"""Cluster-wide keys of full KV blocks: a SHA-256 chain over tokens, rooted in the KV layout.

Every prefill caches its full blocks under these keys, a storage tier may store them under the
same keys, and the gateway remembers which prefill computed which keys to route a request to
the cache that holds its prefix. Plain Python only (no numpy, no torch), so the gateway can
import it; the digests are part of the cluster's contract and must never change.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    """The tokens as little-endian int64, back to back."""
    try:
        return struct.pack(f"<{len(token_ids)}q", *token_ids)
    except struct.error as error:
        bad = [t for t in token_ids if not _INT64_MIN <= int(t) <= _INT64_MAX]
        raise ValueError(f"token ids must fit in int64, got {bad[:3]}") from error


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The prefix hash of a full block: chained over its parent's hash and its own tokens.

    The hash is stable across processes (SHA-256 over the parent digest and the tokens as
    little-endian int64), so two instances agree on which prefix a block holds.

    Args:
        parent_hash: Hash of the previous block of the sequence, ``None`` for the first block.
        token_ids: The tokens held by this block.

    Returns:
        A 32-byte digest.

    Raises:
        ValueError: If a token id does not fit in int64.
    """
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(_token_bytes(token_ids))
    return digest.digest()


def layout_root(fingerprint: str) -> BlockHash:
    """The parent hash of a sequence's first block for one KV layout.

    Chains rooted here are the block keys every instance and the storage tier share: a key
    names the tokens of its block and of every block before it, *and* the KV layout (model,
    layers, heads, head size, dtype, block size), so it can never match KV of another model.
    """
    return hashlib.sha256(b"pdserve-kv-prefix-v1|" + fingerprint.encode()).digest()


def prefix_block_keys(
    fingerprint: str, token_ids: Sequence[int], block_size: int
) -> list[BlockHash]:
    """The keys of the full blocks of `token_ids` (a partial last block has none).

    Args:
        fingerprint: The KV layout fingerprint (`pdserve.common.protocol.kv_layout_fingerprint`).
        token_ids: The sequence, from its first token.
        block_size: Tokens per KV block of that layout.

    Returns:
        One 32-byte key per full block, in order; key ``i`` names blocks ``0..i``.
    """
    # NOTE: the same chain as `hash_block_tokens`, with the tokens packed once and one hash
    # call per block: a 2,048-token prompt takes about half the time (the gateway does this
    # for every routing decision).
    num_full = len(token_ids) // block_size * block_size
    packed = _token_bytes(token_ids[:num_full])
    stride = 8 * block_size
    sha256 = hashlib.sha256
    keys: list[BlockHash] = []
    parent = layout_root(fingerprint)
    for start in range(0, len(packed), stride):
        parent = sha256(parent + packed[start : start + stride]).digest()
        keys.append(parent)
    return keys
