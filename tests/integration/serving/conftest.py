"""Fixtures of the KV storage tier tests: a small KV layout, filled caches, stores of each kind."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.redis_server import RedisServer, running_redis

from pdserve.kv.store import KvStore
from pdserve.kv.stores import open_store


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server per test module (tests that stop a server start their own)."""
    with running_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(params=["file", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[KvStore]:
    """An empty store of each backend."""
    if request.param == "file":
        spec = f"file:{tmp_path / 'kv'}"
    else:
        server: RedisServer = request.getfixturevalue("redis_server")
        spec = server.spec
    kv_store = open_store(spec)
    if request.param == "redis":
        # NOTE: the server is shared by the module's tests; start each from an empty database.
        kv_store._client.flushdb()  # type: ignore[attr-defined]
    try:
        yield kv_store
    finally:
        kv_store.close()
