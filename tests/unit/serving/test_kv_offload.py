"""The KV store writer: writes land in order, a writer that falls behind drops the oldest write,
and a store that is down fails the write (never the caller)."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence

import pytest

from pdserve.kv.offload import KvStoreWriter, WriteDropped
from pdserve.kv.store import KvStore, KvStoreUnavailable
from pdserve.serving.config import DEFAULT_KV_STORE_QUEUE_LEN
from pdserve.serving.kv_tier import kv_store_counters

FINGERPRINT = "ab" * 32
KEY = bytes(32)


class _GatedStore(KvStore):
    """A store whose writes wait for `gate`; `is_down` makes them fail."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.is_down = False
        self.written: list[bytes] = []

    def _put_many(self, entries: Mapping[bytes, bytes]) -> int:
        self.gate.wait(5)
        if self.is_down:
            raise KvStoreUnavailable("down")
        self.written.extend(entries)
        return sum(len(v) for v in entries.values())

    def _get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return [None] * len(keys)

    def _contains_prefix(self, keys: Sequence[bytes]) -> int:
        return 0

    def close(self) -> None:
        pass


def _key(i: int) -> bytes:
    return bytes([i]) * 32


def test_a_writer_behind_drops_the_oldest_write() -> None:
    store = _GatedStore()
    writer = KvStoreWriter(store, FINGERPRINT, max_queue_len=2)
    writer.start()
    try:
        first = writer.submit("r0", {_key(0): b"x"})  # taken by the thread, blocked in put
        while writer.num_queued:
            time.sleep(0.001)
        queued = [writer.submit(f"r{i}", {_key(i): b"x"}) for i in (1, 2, 3)]
        with pytest.raises(WriteDropped):
            queued[0].result(5)
        store.gate.set()
        assert [f.result(5) for f in (first, *queued[1:])] == [89, 89, 89]
        assert store.written == [_key(0), _key(2), _key(3)]
        assert (writer.num_written, writer.num_dropped, writer.num_failed) == (3, 1, 0)
    finally:
        writer.stop()


def test_a_store_that_is_down_fails_the_write_and_counts_it() -> None:
    store = _GatedStore()
    store.is_down = True
    store.gate.set()
    writer = KvStoreWriter(store, FINGERPRINT, DEFAULT_KV_STORE_QUEUE_LEN)
    writer.start()
    try:
        with pytest.raises(KvStoreUnavailable):
            writer.submit("r", {_key(1): b"payload"}).result(5)
        assert writer.num_failed == 1
        assert kv_store_counters(store, 16)["kv_store_errors"][1] == 1
    finally:
        writer.stop()


def test_writes_left_at_stop_are_dropped() -> None:
    store = _GatedStore()
    writer = KvStoreWriter(store, FINGERPRINT, DEFAULT_KV_STORE_QUEUE_LEN)
    writer.stop()
    with pytest.raises(WriteDropped):
        writer.submit("r", {_key(1): b"x"}).result(1)
