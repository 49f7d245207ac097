"""open_store: the spec strings it accepts and the clear errors for the rest."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.kv.file_store import FileKvStore
from pdserve.kv.redis_store import RedisKvStore
from pdserve.kv.stores import DEFAULT_FILE_MAX_BYTES, open_store


def test_file_specs_open_a_directory_store(tmp_path: Path) -> None:
    default = open_store(f"file:{tmp_path / 'a'}")
    bounded = open_store(f"file:{tmp_path / 'b'}?max_bytes=4096")

    assert isinstance(default, FileKvStore) and default.max_bytes == DEFAULT_FILE_MAX_BYTES
    assert isinstance(bounded, FileKvStore) and bounded.max_bytes == 4096
    assert (tmp_path / "a").is_dir() and (tmp_path / "b").is_dir()


@pytest.mark.parametrize(
    ("spec", "address", "ttl_s"),
    [
        ("redis://127.0.0.1:6390", "127.0.0.1:6390/0", None),
        ("redis://cache.internal:6379/3?ttl_s=60", "cache.internal:6379/3", 60),
        ("valkey://10.0.0.7:6379/1", "10.0.0.7:6379/1", None),
    ],
)
def test_redis_specs_open_a_redis_store(spec: str, address: str, ttl_s: int | None) -> None:
    store = open_store(spec)  # connects lazily: no server needed
    assert isinstance(store, RedisKvStore)
    assert (store.address, store.ttl_s) == (address, ttl_s)
    store.close()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "unsupported KV store spec"),
        ("/var/cache/pdserve", "unsupported KV store spec"),
        ("s3://bucket/kv", "unsupported KV store spec"),
        ("file:", "must be file:DIR"),
        ("file:///tmp/kv", "must be file:DIR"),
        ("file:kv?max_bytes=lots", "max_bytes .* must be an integer"),
        ("file:kv?max_bytes=0", "max_bytes .* must be positive"),
        ("file:kv?ttl_s=5", r"unknown parameter\(s\) \['ttl_s'\]"),
        ("file:kv?max_bytes", "malformed query"),
        ("redis://127.0.0.1", "must be redis://HOST:PORT"),
        ("redis://:6379", "must be redis://HOST:PORT"),
        ("redis://host:port", "must be redis://HOST:PORT"),
        ("redis://host:6379/zero", "must be redis://HOST:PORT"),
        ("valkey://host", "must be valkey://HOST:PORT"),
        ("redis://host:6379?ttl_s=-1", "ttl_s .* must be positive"),
        ("redis://host:6379?timeout_s=soon", "timeout_s .* must be a number"),
        ("redis://host:6379?max_bytes=10", "unknown parameter"),
    ],
)
def test_unsupported_specs_are_rejected_with_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        open_store(spec)
