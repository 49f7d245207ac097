"""Behaviour every KV store backend shares (each test runs on file: and on a real redis-server)."""

from __future__ import annotations

import threading

import torch
from support.kv_blocks import FINGERPRINT, LAYOUT, OTHER_FINGERPRINT, block_keys, filled_cache

from pdserve.kv.codec import (
    MissCause,
    block_payload_nbytes,
    encode_block,
    export_block_payloads,
    import_block_payloads,
)
from pdserve.kv.store import KvStore

PAYLOAD_NBYTES = block_payload_nbytes(LAYOUT)


def test_offloaded_blocks_load_into_another_cache_unchanged(store: KvStore) -> None:
    source, target = filled_cache(seed=1), filled_cache(seed=2)
    keys = block_keys(3)
    payloads = export_block_payloads(source, [4, 1, 6])

    num_written = store.put_blocks(FINGERPRINT, dict(zip(keys, payloads, strict=True)))
    loaded = store.get_blocks(keys, FINGERPRINT, PAYLOAD_NBYTES)

    assert loaded == payloads
    import_block_payloads(target, [0, 2, 5], [p for p in loaded if p is not None])
    for src, dst in [(4, 0), (1, 2), (6, 5)]:
        assert torch.equal(target.kv[:, :, dst], source.kv[:, :, src])
    stats = store.stats.snapshot()
    assert stats.num_hits == 3
    assert sum(stats.num_misses.values()) == 0
    assert num_written == stats.num_bytes_stored == stats.num_bytes_loaded > 3 * PAYLOAD_NBYTES
    assert stats.put_seconds > 0 and stats.get_seconds > 0


def test_contains_prefix_counts_leading_stored_keys(store: KvStore) -> None:
    keys = block_keys(5)
    (payload,) = export_block_payloads(filled_cache(), [0])
    assert store.contains_prefix(keys) == 0
    store.put_blocks(FINGERPRINT, {k: payload for k in keys[:3]})
    store.put_blocks(FINGERPRINT, {keys[4]: payload})

    assert store.contains_prefix(keys) == 3
    assert store.contains_prefix(keys[:2]) == 2
    assert store.contains_prefix(keys[3:]) == 0
    assert store.contains_prefix([]) == 0


def test_every_unusable_entry_is_a_miss_counted_by_cause(store: KvStore) -> None:
    (payload,) = export_block_payloads(filled_cache(), [2])
    good, truncated, flipped, foreign, misplaced, absent = block_keys(6)
    entry = encode_block(FINGERPRINT, flipped, payload)
    store.put_many(
        {
            good: encode_block(FINGERPRINT, good, payload),
            truncated: encode_block(FINGERPRINT, truncated, payload)[:-10],
            flipped: entry[:100] + bytes([entry[100] ^ 0x40]) + entry[101:],
            foreign: encode_block(OTHER_FINGERPRINT, foreign, payload),
            misplaced: encode_block(FINGERPRINT, good, payload),
        }
    )

    loaded = store.get_blocks(
        [good, truncated, flipped, foreign, misplaced, absent], FINGERPRINT, PAYLOAD_NBYTES
    )

    assert loaded == [payload, None, None, None, None, None]
    stats = store.stats.snapshot()
    assert stats.num_hits == 1
    assert stats.num_misses == {
        MissCause.MISSING: 1,
        MissCause.TRUNCATED: 1,
        MissCause.CORRUPT: 1,
        MissCause.LAYOUT_MISMATCH: 1,
        MissCause.KEY_MISMATCH: 1,
    }


def test_concurrent_writers_of_one_key_leave_a_valid_entry(store: KvStore) -> None:
    (key,) = block_keys(1)
    cache = filled_cache(seed=3)
    versions = export_block_payloads(cache, list(range(4)))
    seen: list[bytes | None] = []
    stop = threading.Event()

    def write(payload: bytes) -> None:
        for _ in range(30):
            store.put_blocks(FINGERPRINT, {key: payload})

    def read() -> None:
        while not stop.is_set():
            seen.extend(store.get_blocks([key], FINGERPRINT, PAYLOAD_NBYTES))

    readers = [threading.Thread(target=read) for _ in range(2)]
    writers = [threading.Thread(target=write, args=(p,)) for p in versions]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    for t in readers:
        t.join()

    (final,) = store.get_blocks([key], FINGERPRINT, PAYLOAD_NBYTES)
    assert final in versions
    # NOTE: a reader may come before the first write (missing), never upon a torn entry.
    assert all(p is None or p in versions for p in seen)
    misses = store.stats.snapshot().num_misses
    assert {cause: n for cause, n in misses.items() if n and cause != MissCause.MISSING} == {}
