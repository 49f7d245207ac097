"""The ``redis://`` KV store: entries in a shared Redis (or Valkey) under ``pdserve:kv:<hex key>``.

Batches are one round trip each: a pipeline of SETs, one MGET, a pipeline of EXISTS. The size
bound is the server's (``maxmemory`` with ``maxmemory-policy allkeys-lru``); an optional TTL
makes entries expire on their own. Every socket operation has a timeout and a connection is
retried once, so a server that is down or hangs raises `KvStoreUnavailable` within about twice
`timeout_s`. A server that does not answer (refused, timed out) is taken as down: operations are
skipped at once while a probe pings it every `PROBE_INTERVAL_S` (`pdserve.kv.store`), so only
the operations in flight when it went away wait for the timeout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pdserve.kv.store import KvStore, KvStoreUnavailable, KvStoreUnreachable

KEY_PREFIX = b"pdserve:kv:"
PROBE_INTERVAL_S = 1.0


def _store_error(address: str, error: redis.RedisError) -> KvStoreUnavailable:
    """`KvStoreUnreachable` for a server that did not answer, else `KvStoreUnavailable`."""
    message = f"KV store redis://{address}: {error}"
    if isinstance(error, redis.ConnectionError | redis.TimeoutError):
        return KvStoreUnreachable(message)
    return KvStoreUnavailable(message)


class RedisKvStore(KvStore):
    """Entries in Redis (see the module docstring).

    Args:
        host: Server host.
        port: Server port.
        db: Database number.
        ttl_s: Seconds an entry lives after it is written (None: until evicted).
        timeout_s: Connect and read/write timeout of every socket operation.
    """

    probe_interval_s = PROBE_INTERVAL_S

    def __init__(
        self, host: str, port: int, db: int = 0, ttl_s: int | None = None, timeout_s: float = 2.0
    ) -> None:
        super().__init__()
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.address = f"{host}:{port}/{db}"
        self.name = f"redis://{self.address}"
        self.ttl_s = ttl_s
        # NOTE: one retry lets a pooled connection that the server closed reconnect, without
        # multiplying the wait when the server is really gone.
        self._client = redis.Redis(
            host=host,
            port=port,
            db=db,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1),
        )

    @staticmethod
    def redis_key(key: bytes) -> bytes:
        """The Redis key of a block key."""
        return KEY_PREFIX + key.hex().encode()

    def _put_many(self, entries: Mapping[bytes, bytes]) -> int:
        if not entries:
            return 0
        try:
            with self._client.pipeline(transaction=False) as pipe:
                for key, blob in entries.items():
                    pipe.set(self.redis_key(key), blob, ex=self.ttl_s)
                pipe.execute()
        except redis.RedisError as e:
            raise _store_error(self.address, e) from e
        return sum(len(blob) for blob in entries.values())

    def _get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        try:
            blobs = self._client.mget([self.redis_key(key) for key in keys])
        except redis.RedisError as e:
            raise _store_error(self.address, e) from e
        return list(blobs)  # type: ignore[arg-type]

    def _contains_prefix(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        try:
            with self._client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.exists(self.redis_key(key))
                present = pipe.execute()
        except redis.RedisError as e:
            raise _store_error(self.address, e) from e
        for num_present, is_present in enumerate(present):
            if not is_present:
                return num_present
        return len(keys)

    def _ping(self) -> None:
        try:
            self._client.ping()
        except redis.RedisError as e:
            raise _store_error(self.address, e) from e

    def close(self) -> None:
        """Stops probing and closes the connection pool."""
        self._stop_probing()
        self._client.close()
