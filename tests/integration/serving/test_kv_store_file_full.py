"""The file: KV store on a full disk (a small tmpfs, filled to the last byte): writes fail and
are counted, reads go on, one warning says so, and the first write that finds room again lands
(no write is skipped meanwhile: a full disk is not an unreachable store)."""

from __future__ import annotations

from pathlib import Path

import pytest
from structlog.testing import capture_logs
from support.kv_blocks import FINGERPRINT, LAYOUT, block_keys, filled_cache
from support.small_disk import small_disk

from pdserve.kv.codec import block_payload_nbytes, export_block_payloads
from pdserve.kv.offload import KvStoreWriter
from pdserve.kv.store import KvStoreFull, KvStoreSkipped
from pdserve.kv.stores import open_store
from pdserve.serving.config import DEFAULT_KV_STORE_QUEUE_LEN
from pdserve.serving.kv_tier import kv_store_counters

PAYLOAD_NBYTES = block_payload_nbytes(LAYOUT)
NUM_WRITES = 5


def test_a_full_disk_fails_writes_with_one_warning_and_room_again_is_used(
    tmp_path: Path,
) -> None:
    keys = block_keys(NUM_WRITES + 2)
    payloads = export_block_payloads(filled_cache(), list(range(NUM_WRITES + 2)))
    with (
        small_disk(tmp_path / "disk", size_bytes=4 << 20) as disk,
        open_store(f"file:{disk.root / 'kv'}?max_bytes={2 << 20}") as store,
        capture_logs() as logs,
    ):
        writer = KvStoreWriter(store, FINGERPRINT, DEFAULT_KV_STORE_QUEUE_LEN)
        writer.start()
        try:
            writer.submit("before", {keys[0]: payloads[0]}).result(5)
            disk.fill()
            for i in range(1, NUM_WRITES + 1):
                with pytest.raises(KvStoreFull, match="No space left"):
                    writer.submit(f"r{i}", {keys[i]: payloads[i]}).result(5)
            # NOTE: a full disk still reads.
            assert store.get_blocks(keys[:1], FINGERPRINT, PAYLOAD_NBYTES) == payloads[:1]
            assert store.contains_prefix(keys) == 1
            disk.free()
            writer.submit("after", {keys[-1]: payloads[-1]}).result(5)
        finally:
            writer.stop()
        assert store.get_blocks(keys[-1:], FINGERPRINT, PAYLOAD_NBYTES) == payloads[-1:]
        assert writer.num_failed == NUM_WRITES
        stats = store.stats.snapshot()
        assert (stats.num_errors, stats.num_full, stats.num_skipped) == (NUM_WRITES, 1, 0)
        assert kv_store_counters(store, 16)["kv_store_full"][1] == 1
    store_events = [
        (e["event"], e["log_level"])
        for e in logs
        if str(e["event"]).startswith("kv_store_") and e["log_level"] != "debug"
    ]
    assert store_events == [("kv_store_full", "warning"), ("kv_store_has_room", "info")]
    assert not issubclass(KvStoreFull, KvStoreSkipped)
