"""The KV storage tier: a shared store of full KV blocks, addressed by their prefix block keys.

A decode offloads a preempted request's blocks before freeing them; a prefill loads the longest
stored prefix instead of recomputing it; instances share prefixes. Keys come from
`pdserve.engine.block_pool.prefix_block_keys`, entries from `pdserve.kv.codec`. This module is
the interface (`KvStore`) and its statistics; `pdserve.kv.stores` opens a backend from a spec.

Stores are synchronous and thread-safe: run them on worker threads, never on an event loop. A
store that cannot be reached raises `KvStoreUnavailable`, which callers catch and treat as a
miss (load) or a skipped offload.
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import TracebackType

from pdserve.kv.codec import BlockMiss, MissCause, decode_block, encode_block


class KvStoreUnavailable(Exception):
    """The store cannot be reached or refused the operation; nothing was loaded or stored."""


@dataclass
class KvStoreStats:
    """Cumulative counters of one store object (thread-safe: change them through `record_*`).

    Attributes:
        num_hits: Blocks `get_blocks` returned.
        num_misses: Blocks `get_blocks` did not return, by `MissCause` value.
        num_bytes_stored: Entry bytes written by `put_many`.
        num_bytes_loaded: Entry bytes read by `get_many`.
        num_evictions: Entries the store removed to stay within its size bound.
        num_errors: Operations that raised `KvStoreUnavailable`.
        get_seconds: Time spent in `get_many`.
        put_seconds: Time spent in `put_many`.
    """

    num_hits: int = 0
    num_misses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MissCause, 0))
    num_bytes_stored: int = 0
    num_bytes_loaded: int = 0
    num_evictions: int = 0
    num_errors: int = 0
    get_seconds: float = 0.0
    put_seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record_lookup(self, num_hits: int, misses: Sequence[MissCause]) -> None:
        with self._lock:
            self.num_hits += num_hits
            for cause in misses:
                self.num_misses[cause] += 1

    def record_io(
        self, *, get_s: float = 0.0, put_s: float = 0.0, loaded: int = 0, stored: int = 0
    ) -> None:
        with self._lock:
            self.get_seconds += get_s
            self.put_seconds += put_s
            self.num_bytes_loaded += loaded
            self.num_bytes_stored += stored

    def record_evictions(self, count: int) -> None:
        with self._lock:
            self.num_evictions += count

    def record_error(self) -> None:
        with self._lock:
            self.num_errors += 1

    def snapshot(self) -> KvStoreStats:
        """A consistent copy, e.g. for a metrics exporter."""
        with self._lock:
            return replace(self, num_misses=dict(self.num_misses), _lock=threading.Lock())


class KvStore(abc.ABC):
    """A key-value store of encoded KV block entries (`kv_block_codec.encode_block`).

    Every method is synchronous and thread-safe, and raises `KvStoreUnavailable` (never a
    backend's own exception type) when the store cannot serve it.
    """

    def __init__(self) -> None:
        self.stats = KvStoreStats()

    def put_many(self, entries: Mapping[bytes, bytes]) -> int:
        """Stores entries (block key -> encoded entry), replacing any under the same keys.

        Returns:
            Bytes written.
        """
        start, written = time.perf_counter(), 0
        try:
            written = self._put_many(entries)
            return written
        except KvStoreUnavailable:
            self.stats.record_error()
            raise
        finally:
            self.stats.record_io(put_s=time.perf_counter() - start, stored=written)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The raw entries stored under `keys`, None where there is none (unchecked: see
        `get_blocks`)."""
        start, loaded = time.perf_counter(), 0
        try:
            blobs = self._get_many(keys)
            loaded = sum(len(b) for b in blobs if b is not None)
            return blobs
        except KvStoreUnavailable:
            self.stats.record_error()
            raise
        finally:
            self.stats.record_io(get_s=time.perf_counter() - start, loaded=loaded)

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` have an entry (the longest stored prefix, unchecked)."""
        try:
            return self._contains_prefix(keys)
        except KvStoreUnavailable:
            self.stats.record_error()
            raise

    def put_blocks(self, fingerprint: str, payloads: Mapping[bytes, bytes]) -> int:
        """Encodes and stores block payloads (block key -> `export_block_payloads` bytes).

        Returns:
            Bytes written.
        """
        return self.put_many({k: encode_block(fingerprint, k, p) for k, p in payloads.items()})

    def get_blocks(
        self, keys: Sequence[bytes], fingerprint: str, payload_nbytes: int
    ) -> list[bytes | None]:
        """The checked payloads under `keys`, None for each miss; counts hits and misses by cause.

        A prefix load uses the payloads up to the first None.

        Args:
            keys: Block keys, e.g. a request's `prefix_block_keys`.
            fingerprint: The caller's KV layout fingerprint.
            payload_nbytes: `block_payload_nbytes` of the caller's layout.
        """
        results: list[bytes | None] = []
        misses: list[MissCause] = []
        for key, blob in zip(keys, self.get_many(keys), strict=True):
            decoded = decode_block(blob, fingerprint, key, payload_nbytes)
            if isinstance(decoded, BlockMiss):
                misses.append(decoded.cause)
                results.append(None)
            else:
                results.append(decoded)
        self.stats.record_lookup(len(results) - len(misses), misses)
        return results

    @abc.abstractmethod
    def close(self) -> None:
        """Releases connections; the store must not be used afterwards."""

    def __enter__(self) -> KvStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @abc.abstractmethod
    def _put_many(self, entries: Mapping[bytes, bytes]) -> int: ...

    @abc.abstractmethod
    def _get_many(self, keys: Sequence[bytes]) -> list[bytes | None]: ...

    @abc.abstractmethod
    def _contains_prefix(self, keys: Sequence[bytes]) -> int: ...
