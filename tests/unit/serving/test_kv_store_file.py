"""The file: KV store: entries on disk, damage on disk, the size bound and its eviction order."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.kv_blocks import FINGERPRINT, LAYOUT, block_keys, filled_cache

from pdserve.kv.codec import (
    HEADER_NBYTES,
    MissCause,
    block_payload_nbytes,
    encode_block,
    export_block_payloads,
)
from pdserve.kv.file_store import FileKvStore
from pdserve.kv.store import KvStoreUnavailable

PAYLOAD_NBYTES = block_payload_nbytes(LAYOUT)
ENTRY_NBYTES = HEADER_NBYTES + PAYLOAD_NBYTES


def _entry_files(root: Path) -> list[Path]:
    return sorted(root.glob("*/*.kv"))


def test_entries_are_one_file_per_block_fanned_out_by_key(tmp_path: Path) -> None:
    store = FileKvStore(tmp_path, max_bytes=1 << 20)
    keys = block_keys(3)
    payloads = export_block_payloads(filled_cache(), [0, 1, 2])
    store.put_blocks(FINGERPRINT, dict(zip(keys, payloads, strict=True)))

    expected = sorted(tmp_path / k.hex()[:2] / f"{k.hex()}.kv" for k in keys)
    assert _entry_files(tmp_path) == expected
    assert all(p.stat().st_size == ENTRY_NBYTES for p in expected)
    assert not list(tmp_path.glob("*/.*"))  # no temp file left behind


def test_damage_on_disk_is_a_miss(tmp_path: Path) -> None:
    store = FileKvStore(tmp_path, max_bytes=1 << 20)
    cut, flipped, intact = block_keys(3)
    (payload,) = export_block_payloads(filled_cache(), [0])
    store.put_blocks(FINGERPRINT, {cut: payload, flipped: payload, intact: payload})
    os.truncate(store.path_of(cut), ENTRY_NBYTES - 1)
    with open(store.path_of(flipped), "r+b") as f:
        f.seek(HEADER_NBYTES + 5)
        byte = f.read(1)
        f.seek(HEADER_NBYTES + 5)
        f.write(bytes([byte[0] ^ 0x80]))

    loaded = store.get_blocks([cut, flipped, intact], FINGERPRINT, PAYLOAD_NBYTES)

    assert loaded == [None, None, payload]
    misses = store.stats.snapshot().num_misses
    assert misses[MissCause.TRUNCATED] == 1 and misses[MissCause.CORRUPT] == 1


def test_eviction_keeps_the_bound_and_drops_the_least_recently_used(tmp_path: Path) -> None:
    # NOTE: room for 3.5 entries; an eviction brings the total to 90 %, i.e. 3 entries.
    store = FileKvStore(tmp_path, max_bytes=int(3.5 * ENTRY_NBYTES), low_water=0.9)
    a, b, c, d, e = block_keys(5)
    (payload,) = export_block_payloads(filled_cache(), [0])

    for key in (a, b, c):
        store.put_blocks(FINGERPRINT, {key: payload})
    assert store.get_blocks([a], FINGERPRINT, PAYLOAD_NBYTES) == [payload]  # a is now recent
    store.put_blocks(FINGERPRINT, {d: payload})
    store.put_blocks(FINGERPRINT, {e: payload})

    present = {k: store.contains_prefix([k]) == 1 for k in (a, b, c, d, e)}
    assert present == {a: True, b: False, c: False, d: True, e: True}
    assert store.stats.snapshot().num_evictions == 2
    assert sum(p.stat().st_size for p in _entry_files(tmp_path)) <= store.max_bytes
    assert store.num_bytes == 3 * ENTRY_NBYTES


def test_a_reopened_store_counts_what_is_already_on_disk(tmp_path: Path) -> None:
    keys = block_keys(4)
    (payload,) = export_block_payloads(filled_cache(), [0])
    FileKvStore(tmp_path, max_bytes=1 << 20).put_blocks(FINGERPRINT, {k: payload for k in keys[:3]})

    reopened = FileKvStore(tmp_path, max_bytes=int(3.5 * ENTRY_NBYTES))
    assert reopened.num_bytes == 3 * ENTRY_NBYTES
    reopened.put_blocks(FINGERPRINT, {keys[3]: payload})

    assert reopened.stats.snapshot().num_evictions == 1
    assert reopened.contains_prefix(keys) == 0  # the oldest, keys[0], went first


def test_a_store_over_an_unwritable_directory_raises_unavailable(tmp_path: Path) -> None:
    store = FileKvStore(tmp_path / "kv", max_bytes=1 << 20)
    (key,) = block_keys(1)
    (tmp_path / "kv" / key.hex()[:2]).write_bytes(b"a file where the fan-out directory goes")
    with pytest.raises(KvStoreUnavailable):
        store.put_blocks(FINGERPRINT, {key: export_block_payloads(filled_cache(), [0])[0]})
    assert store.stats.snapshot().num_errors == 1


_WRITER = """
import os, sys, time
from pdserve.kv.codec import BlockMiss, decode_block
from pdserve.kv.file_store import FileKvStore

root, go, fingerprint, key_hex, payload_nbytes, *blob_paths = sys.argv[1:]
key = bytes.fromhex(key_hex)
blobs = [open(p, "rb").read() for p in blob_paths]
store = FileKvStore(root, max_bytes=1 << 30)
print("ready", flush=True)
while not os.path.exists(go):  # start together, so that the writes overlap
    time.sleep(0.001)
for i in range(60):
    store.put_many({key: blobs[i % len(blobs)]})
    (blob,) = store.get_many([key])
    if isinstance(decode_block(blob, fingerprint, key, int(payload_nbytes)), BlockMiss):
        sys.exit("a reader saw an unusable entry")
"""


def test_processes_writing_the_same_key_leave_a_valid_entry(tmp_path: Path) -> None:
    (key,) = block_keys(1)
    # NOTE: 1 MiB entries make the window of a torn write wide enough to be seen.
    payloads = [os.urandom(1 << 20) for _ in range(3)]
    blob_paths = []
    for i, payload in enumerate(payloads):
        blob_paths.append(tmp_path / f"blob{i}")
        blob_paths[-1].write_bytes(encode_block(FINGERPRINT, key, payload))
    root, go = tmp_path / "kv", tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    args = [root, go, FINGERPRINT, key.hex(), 1 << 20]
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, *map(str, args + blob_paths[i:])],
            env=env,
            stdout=subprocess.PIPE,
        )
        for i in range(3)
    ]
    try:
        assert all(w.stdout is not None and w.stdout.readline() == b"ready\n" for w in writers)
        go.touch()
        assert [w.wait(timeout=120) for w in writers] == [0, 0, 0]
    finally:
        for w in writers:
            w.kill()
            w.wait()
            if w.stdout is not None:
                w.stdout.close()
    store = FileKvStore(root, max_bytes=1 << 30)
    assert store.get_blocks([key], FINGERPRINT, 1 << 20)[0] in payloads
    assert _entry_files(root) == [store.path_of(key)]
    assert not list(root.glob("*/.*"))
