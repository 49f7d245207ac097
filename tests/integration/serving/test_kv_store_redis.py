"""The redis:// KV store against a real redis-server: key names, TTL, a server that is gone, and
one that does not answer (as behind a network partition): found unreachable once, then skipped
at once until a probe reaches it again."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from structlog.testing import capture_logs
from support.eventually import eventually
from support.kv_blocks import FINGERPRINT, LAYOUT, block_keys, filled_cache
from support.redis_server import RedisServer, running_redis

from pdserve.kv.codec import block_payload_nbytes, export_block_payloads
from pdserve.kv.redis_store import PROBE_INTERVAL_S
from pdserve.kv.store import KvStore, KvStoreSkipped, KvStoreUnavailable
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
        # NOTE: the first operation found it gone (refused); the others were skipped.
        stats = store.stats.snapshot()
        assert (stats.num_errors, stats.num_unreachable, stats.num_skipped) == (1, 1, 3)


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


def test_a_server_that_never_answers_is_waited_on_once_then_skipped(silent_port: int) -> None:
    """A partition: the first operation waits for the timeout (twice, with the retry), every
    later one is skipped at once, without I/O, while the probe keeps failing."""
    keys = block_keys(2)
    with (
        capture_logs() as logs,
        open_store(f"redis://127.0.0.1:{silent_port}?timeout_s=0.3") as store,
    ):
        started = time.monotonic()
        with pytest.raises(KvStoreUnavailable):
            store.contains_prefix(keys)
        assert time.monotonic() - started >= 0.3
        assert not store.is_reachable
        for call in (
            lambda: store.contains_prefix(keys),
            lambda: store.get_blocks(keys, FINGERPRINT, PAYLOAD_NBYTES),
            lambda: store.put_many({keys[0]: b"x"}),
        ):
            # NOTE: skipped, not tried: a try would wait out the timeout and raise
            # KvStoreUnavailable, and count an error (the stats below)
            with pytest.raises(KvStoreSkipped, match="unreachable"):
                call()
        time.sleep(2 * PROBE_INTERVAL_S + 1.0)  # NOTE: probes meanwhile, none answered
        assert not store.is_reachable
        stats = store.stats.snapshot()
        assert (stats.num_errors, stats.num_unreachable, stats.num_skipped) == (1, 1, 3)
    assert [e["event"] for e in logs if e["event"].startswith("kv_store_")] == [
        "kv_store_unreachable"
    ]


async def test_a_store_found_unreachable_is_used_again_once_its_probe_reaches_it(
    tmp_path: Path,
) -> None:
    keys = block_keys(2)
    (payload,) = export_block_payloads(filled_cache(), [0])
    with (
        capture_logs() as logs,
        running_redis(tmp_path) as server,
        open_store(f"{server.spec}?timeout_s=0.5") as store,
    ):
        store.put_blocks(FINGERPRINT, {keys[0]: payload})
        server.stop()
        with pytest.raises(KvStoreUnavailable):
            store.contains_prefix(keys)
        with pytest.raises(KvStoreSkipped):
            store.contains_prefix(keys)
        server.start()
        await eventually(lambda: store.is_reachable, 5 * PROBE_INTERVAL_S, "the probe reached it")
        store.put_blocks(FINGERPRINT, {keys[0]: payload})  # NOTE: a new server: nothing kept
        assert store.contains_prefix(keys) == 1
        assert store.get_blocks(keys[:1], FINGERPRINT, PAYLOAD_NBYTES) == [payload]
        assert store.stats.snapshot().num_unreachable == 1
    events = [e["event"] for e in logs if e["event"].startswith("kv_store_")]
    assert events == ["kv_store_unreachable", "kv_store_reachable"]


def test_a_refused_operation_does_not_take_the_store_as_unreachable(tmp_path: Path) -> None:
    """A server that answers with an error (out of memory) is reachable: only that operation
    fails, the next one is tried."""
    keys = block_keys(1)
    with running_redis(tmp_path) as server, open_store(server.spec) as store:
        raw = redis.Redis(port=server.port)
        raw.config_set("maxmemory-policy", "noeviction")
        raw.config_set("maxmemory", 1)
        with pytest.raises(KvStoreUnavailable, match="maxmemory"):
            store.put_many({keys[0]: b"x" * 1024})
        assert store.is_reachable
        assert store.contains_prefix(keys) == 0
        raw.close()
        stats = store.stats.snapshot()
        assert (stats.num_errors, stats.num_unreachable, stats.num_skipped) == (1, 0, 0)
