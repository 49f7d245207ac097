"""The redis:// KV store against a real redis-server: key names, TTL, and a server that is gone."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from support.kv_blocks import FINGERPRINT, LAYOUT, block_keys, filled_cache
from support.redis_server import RedisServer, running_redis

from pdserve.kv.codec import block_payload_nbytes, export_block_payloads
from pdserve.kv.store import KvStore, KvStoreUnavailable
from pdserve.kv.stores import open_store

PAYLOAD_NBYTES = block_payload_nbytes(LAYOUT)


def test_entries_live_under_pdserve_keys_with_the_ttl(redis_server: RedisServer) -> None:
    keys = block_keys(2)
    payloads = export_block_payloads(filled_cache(), [0, 1])
    raw = redis.Redis(port=redis_server.port)
    with open_store(f"{redis_server.spec}?ttl_s=600") as store:
        store.put_blocks(FINGERPRINT, dict(zip(keys, payloads, strict=True)))

    for key in keys:
        name = b"pdserve:kv:" + key.hex().encode()
        assert raw.exists(name) == 1
        assert 0 < raw.ttl(name) <= 600
    raw.close()


def _raises_unavailable_quickly(call: Callable[[], object], within_s: float) -> None:
    start = time.monotonic()
    with pytest.raises(KvStoreUnavailable):
        call()
    assert time.monotonic() - start < within_s


def test_a_server_that_stops_mid_test_raises_unavailable(tmp_path: Path) -> None:
    keys = block_keys(2)
    (payload,) = export_block_payloads(filled_cache(), [0])
    with running_redis(tmp_path) as server, open_store(server.spec) as store:
        store.put_blocks(FINGERPRINT, {keys[0]: payload})
        assert store.get_blocks(keys[:1], FINGERPRINT, PAYLOAD_NBYTES) == [payload]

        server.stop()

        _raises_unavailable_quickly(lambda: store.get_many(keys), within_s=5)
        _raises_unavailable_quickly(lambda: store.put_blocks(FINGERPRINT, {keys[1]: payload}), 5)
        _raises_unavailable_quickly(lambda: store.contains_prefix(keys), within_s=5)
        _raises_unavailable_quickly(
            lambda: store.get_blocks(keys, FINGERPRINT, PAYLOAD_NBYTES), within_s=5
        )
        assert store.stats.snapshot().num_errors == 4


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers (a hung server)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield int(listener.getsockname()[1])


def test_a_server_that_never_answers_times_out_as_unavailable(silent_port: int) -> None:
    with open_store(f"redis://127.0.0.1:{silent_port}?timeout_s=0.3") as store:
        _raises_unavailable_quickly(lambda: store.get_many(block_keys(1)), within_s=3)
        _raises_unavailable_quickly(lambda: store.contains_prefix(block_keys(1)), within_s=3)


@pytest.fixture
def store_without_server() -> Iterator[KvStore]:
    """A store whose port has no server (nothing listens there)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with open_store(f"valkey://127.0.0.1:{port}/1") as store:
        yield store


def test_a_store_with_no_server_raises_unavailable_not_a_redis_error(
    store_without_server: KvStore,
) -> None:
    with pytest.raises(KvStoreUnavailable, match=r"redis://127\.0\.0\.1"):
        store_without_server.put_many({block_keys(1)[0]: b"x"})
