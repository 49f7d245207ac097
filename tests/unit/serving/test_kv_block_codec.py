"""The stored-block entry format and the copies of blocks out of and into a KV cache."""

from __future__ import annotations

import pytest
import torch
from support.kv_blocks import FINGERPRINT, LAYOUT, OTHER_FINGERPRINT, block_keys, filled_cache

from pdserve.engine.kv_cache import KVCacheLayout
from pdserve.kv.codec import (
    HEADER_NBYTES,
    BlockMiss,
    MissCause,
    block_payload_nbytes,
    decode_block,
    encode_block,
    export_block_payloads,
    import_block_payloads,
)

PAYLOAD_NBYTES = block_payload_nbytes(LAYOUT)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_blocks_copied_out_and_back_land_in_other_blocks_unchanged(dtype: str) -> None:
    layout = KVCacheLayout(3, 2, 8, 4, dtype)
    source = filled_cache(layout, seed=1)
    target = filled_cache(layout, seed=2)
    untouched = target.kv.clone()

    payloads = export_block_payloads(source, [5, 2, 6])
    assert [len(p) for p in payloads] == [block_payload_nbytes(layout)] * 3
    import_block_payloads(target, [0, 7, 3], payloads)

    for src, dst in [(5, 0), (2, 7), (6, 3)]:
        assert torch.equal(target.kv[:, :, dst], source.kv[:, :, src])
    for other in (1, 2, 4, 5, 6):
        assert torch.equal(target.kv[:, :, other], untouched[:, :, other])


def test_payload_is_layer_by_layer_k_then_v() -> None:
    cache = filled_cache()
    (payload,) = export_block_payloads(cache, [3])
    values = torch.frombuffer(bytearray(payload), dtype=torch.float32)
    # expected: [num_layers, 2, block_size, num_kv_heads, head_dim]
    expected = cache.kv[:, :, 3]
    assert torch.equal(values.view(expected.shape), expected)
    first_layer_v = values[LAYOUT.block_nbytes // 4 : 2 * LAYOUT.block_nbytes // 4]
    assert torch.equal(first_layer_v, cache.kv[0, 1, 3].flatten())


def test_import_rejects_payloads_of_another_size() -> None:
    cache = filled_cache()
    with pytest.raises(ValueError, match="payload of this layout"):
        import_block_payloads(cache, [0], [b"\0" * (PAYLOAD_NBYTES - 4)])
    with pytest.raises(ValueError, match="2 block ids but 1 payloads"):
        import_block_payloads(cache, [0, 1], [b"\0" * PAYLOAD_NBYTES])


def test_an_entry_decodes_to_its_payload() -> None:
    (payload,) = export_block_payloads(filled_cache(), [1])
    key = block_keys(1)[0]
    blob = encode_block(FINGERPRINT, key, payload)
    assert len(blob) == HEADER_NBYTES + PAYLOAD_NBYTES
    assert blob[:4] == b"PDKV"
    assert decode_block(blob, FINGERPRINT, key, PAYLOAD_NBYTES) == payload


def _flip(blob: bytes, offset: int) -> bytes:
    return blob[:offset] + bytes([blob[offset] ^ 0x01]) + blob[offset + 1 :]


def _damaged_entries() -> list[tuple[str, bytes | None, MissCause]]:
    (payload,) = export_block_payloads(filled_cache(), [1])
    key = block_keys(1)[0]
    blob = encode_block(FINGERPRINT, key, payload)
    other_key = block_keys(1, salt=1)[0]
    return [
        ("absent", None, MissCause.MISSING),
        ("empty", b"", MissCause.TRUNCATED),
        ("header cut", blob[: HEADER_NBYTES - 1], MissCause.TRUNCATED),
        ("payload cut", blob[:-1], MissCause.TRUNCATED),
        ("flipped payload byte", _flip(blob, HEADER_NBYTES + 17), MissCause.CORRUPT),
        ("flipped checksum byte", _flip(blob, 80), MissCause.CORRUPT),
        ("flipped magic", _flip(blob, 0), MissCause.CORRUPT),
        ("newer format", _flip(blob, 5), MissCause.CORRUPT),
        ("trailing byte", blob + b"\0", MissCause.CORRUPT),
        ("other layout", encode_block(OTHER_FINGERPRINT, key, payload), MissCause.LAYOUT_MISMATCH),
        ("other key", encode_block(FINGERPRINT, other_key, payload), MissCause.KEY_MISMATCH),
        ("flipped key byte", _flip(blob, 40), MissCause.KEY_MISMATCH),
    ]


@pytest.mark.parametrize(("blob", "cause"), [c[1:] for c in _damaged_entries()],
                         ids=[c[0] for c in _damaged_entries()])  # fmt: skip
def test_a_damaged_or_foreign_entry_is_a_miss_with_its_cause(
    blob: bytes | None, cause: MissCause
) -> None:
    key = block_keys(1)[0]
    assert decode_block(blob, FINGERPRINT, key, PAYLOAD_NBYTES) == BlockMiss(cause)


def test_an_entry_of_another_block_size_is_a_layout_mismatch() -> None:
    (payload,) = export_block_payloads(filled_cache(), [1])
    key = block_keys(1)[0]
    blob = encode_block(FINGERPRINT, key, payload)
    result = decode_block(blob, FINGERPRINT, key, PAYLOAD_NBYTES * 2)
    assert result == BlockMiss(MissCause.LAYOUT_MISMATCH)


def test_encode_rejects_a_malformed_key_or_fingerprint() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        encode_block(FINGERPRINT, b"short", b"")
    with pytest.raises(ValueError, match="64 hex digits"):
        encode_block("not-hex", block_keys(1)[0], b"")
