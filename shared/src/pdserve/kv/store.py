"""The KV storage tier: a shared store of full KV blocks, addressed by their prefix block keys.

A decode offloads a preempted request's blocks before freeing them; a prefill loads the longest
stored prefix instead of recomputing it; instances share prefixes. Keys come from
`pdserve.engine.block_pool.prefix_block_keys`, entries from `pdserve.kv.codec`. This module is
the interface (`KvStore`) and its statistics; `pdserve.kv.stores` opens a backend from a spec.

Stores are synchronous and thread-safe: run them on worker threads, never on an event loop. A
store that cannot be reached raises `KvStoreUnavailable`, which callers catch and treat as a
miss (load) or a skipped offload.

**An unreachable store is skipped, not waited on.** A store reached over the network (one whose
class sets `KvStore.probe_interval_s`, e.g. redis) that fails to answer an operation
(`KvStoreUnreachable`: refused, or timed out, as behind a network partition) is taken as down:
every operation after that raises `KvStoreSkipped` at once, without I/O, until a background
probe reaches it again (every `probe_interval_s`). Only the operations in flight when it went
away wait for its timeout; the requests after them compute what they would have loaded instead
of waiting past their leases. One warning says it went unreachable, one line that it is back;
`KvStoreStats` counts both.

**A full store fails writes, and says so once.** A store with no room for a write (a file
store's disk is full: `KvStoreFull`) fails that write, as any refused one; the next is tried
all the same (a write costs the store only its own I/O, and the first that finds room again
lands), and reads go on. One warning says it is full (`kv_store_full`), one line that a write
found room again (`kv_store_has_room`); the writes that failed meanwhile are counted, not
logged one by one.
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import TypeVar

import structlog

from pdserve.kv.codec import BlockMiss, MissCause, decode_block, encode_block

log = structlog.get_logger(__name__)

_T = TypeVar("_T")
_R = TypeVar("_R")


class KvStoreUnavailable(Exception):
    """The store cannot be reached or refused the operation; nothing was loaded or stored."""


class KvStoreUnreachable(KvStoreUnavailable):
    """The store did not answer (connection refused or timed out): a store with a probe is
    taken as down until the probe reaches it again."""


class KvStoreFull(KvStoreUnavailable):
    """The store has no room for the write (its disk is full); reads still work, and the next
    write is tried all the same."""


class KvStoreSkipped(KvStoreUnavailable):
    """The operation was not tried: the store was found unreachable and no probe has reached it
    since (raised at once, without I/O)."""


@dataclass
class KvStoreStats:
    """Cumulative counters of one store object (thread-safe: change them through `add` and
    `record_lookup`).

    Attributes:
        num_hits: Blocks `get_blocks` returned.
        num_misses: Blocks `get_blocks` did not return, by `MissCause` value.
        num_bytes_stored: Entry bytes written by `put_many`.
        num_bytes_loaded: Entry bytes read by `get_many`.
        num_evictions: Entries the store removed to stay within its size bound.
        num_errors: Operations that raised `KvStoreUnavailable` (skipped ones apart).
        num_unreachable: Times the store was found unreachable (each followed by skipping it
            until a probe reached it again).
        num_skipped: Operations not tried because the store was unreachable.
        num_full: Times the store was found full (each followed by writes failing until one
            found room again).
        get_seconds: Time spent in `get_many`.
        put_seconds: Time spent in `put_many`.
    """

    num_hits: int = 0
    num_misses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MissCause, 0))
    num_bytes_stored: int = 0
    num_bytes_loaded: int = 0
    num_evictions: int = 0
    num_errors: int = 0
    num_unreachable: int = 0
    num_skipped: int = 0
    num_full: int = 0
    get_seconds: float = 0.0
    put_seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record_lookup(self, num_hits: int, misses: Sequence[MissCause]) -> None:
        with self._lock:
            self.num_hits += num_hits
            for cause in misses:
                self.num_misses[cause] += 1

    def add(
        self,
        *,
        get_s: float = 0.0,
        put_s: float = 0.0,
        loaded: int = 0,
        stored: int = 0,
        evictions: int = 0,
        errors: int = 0,
        unreachable: int = 0,
        skipped: int = 0,
        full: int = 0,
    ) -> None:
        """Adds to the counters (seconds spent in gets and puts, bytes loaded and stored,
        entries evicted, failed calls, calls while unreachable, skips, refused puts)."""
        with self._lock:
            self.get_seconds += get_s
            self.put_seconds += put_s
            self.num_bytes_loaded += loaded
            self.num_bytes_stored += stored
            self.num_evictions += evictions
            self.num_errors += errors
            self.num_unreachable += unreachable
            self.num_skipped += skipped
            self.num_full += full

    def snapshot(self) -> KvStoreStats:
        """A consistent copy, e.g. for a metrics exporter."""
        with self._lock:
            return replace(self, num_misses=dict(self.num_misses), _lock=threading.Lock())


class KvStore(abc.ABC):
    """A key-value store of encoded KV block entries (`kv_block_codec.encode_block`).

    Every method is synchronous and thread-safe, and raises `KvStoreUnavailable` (never a
    backend's own exception type) when the store cannot serve it; `KvStoreSkipped` at once
    while a store with a probe is down (see the module docstring).

    Attributes:
        name: The store as logs name it, e.g. ``redis://host:port/0``.
        probe_interval_s: Seconds between probes of a store found unreachable (None: the store
            is never taken as down, e.g. a local one, which fails at once anyway).
    """

    name: str = "KV store"
    probe_interval_s: float | None = None

    def __init__(self) -> None:
        self.stats = KvStoreStats()
        self._down_since: float | None = None  # monotonic; None while reachable
        self._full_since: float | None = None  # monotonic; None while writes find room
        self._reach_lock = threading.Lock()
        self._closed = threading.Event()

    @property
    def is_reachable(self) -> bool:
        """False from a failure to reach the store until a probe reached it again."""
        return self._down_since is None

    def put_many(self, entries: Mapping[bytes, bytes]) -> int:
        """Stores entries (block key -> encoded entry), replacing any under the same keys.

        Returns:
            Bytes written.
        """
        start, written = time.perf_counter(), 0
        try:
            written = self._reaching(self._put_many, entries)
        except KvStoreFull as error:
            self._went_full(error)
            raise
        else:
            if self._full_since is not None:
                self._has_room()
            return written
        finally:
            self.stats.add(put_s=time.perf_counter() - start, stored=written)

    def _went_full(self, error: KvStoreFull) -> None:
        """Says once that the store is full (however many writes fail until one finds room)."""
        with self._reach_lock:
            if self._full_since is not None:
                return
            self._full_since = time.monotonic()
        self.stats.add(full=1)
        log.warning(
            "kv_store_full",
            store=self.name,
            error=str(error),
            detail="writes fail (counted in kv_store_errors) until one finds room; reads go on",
        )

    def _has_room(self) -> None:
        """Says once that a write found room again after the store was full."""
        with self._reach_lock:
            full_since, self._full_since = self._full_since, None
        if full_since is not None:
            full_s = round(time.monotonic() - full_since, 2)
            log.info("kv_store_has_room", store=self.name, full_s=full_s)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The raw entries stored under `keys`, None where there is none (unchecked: see
        `get_blocks`)."""
        start, loaded = time.perf_counter(), 0
        try:
            blobs = self._reaching(self._get_many, keys)
            loaded = sum(len(b) for b in blobs if b is not None)
            return blobs
        finally:
            self.stats.add(get_s=time.perf_counter() - start, loaded=loaded)

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` have an entry (the longest stored prefix, unchecked)."""
        return self._reaching(self._contains_prefix, keys)

    def _reaching(self, operation: Callable[[_T], _R], argument: _T) -> _R:
        """`operation(argument)`, unless the store is down (`KvStoreSkipped`); a failure to
        reach it takes it as down (with a probe)."""
        down_since = self._down_since
        if down_since is not None:
            self.stats.add(skipped=1)
            raise KvStoreSkipped(
                f"{self.name} unreachable for {time.monotonic() - down_since:.1f} s: skipped"
            )
        try:
            return operation(argument)
        except KvStoreUnreachable as error:
            self.stats.add(errors=1)
            self._went_unreachable(error)
            raise
        except KvStoreUnavailable:
            self.stats.add(errors=1)
            raise

    def _went_unreachable(self, error: KvStoreUnreachable) -> None:
        """Takes the store as down and starts probing it (once, however many operations
        failed together)."""
        if self.probe_interval_s is None:
            return
        with self._reach_lock:
            if self._down_since is not None or self._closed.is_set():
                return
            self._down_since = time.monotonic()
        self.stats.add(unreachable=1)
        log.warning(
            "kv_store_unreachable",
            store=self.name,
            error=str(error),
            probe_interval_s=self.probe_interval_s,
            detail="skipped (loads miss, writes are dropped) until a probe reaches it again",
        )
        threading.Thread(target=self._probe, name="kv-store-probe", daemon=True).start()

    def _probe(self) -> None:
        """Pings the store every `probe_interval_s` until it answers (or the store closes)."""
        assert self.probe_interval_s is not None
        while not self._closed.wait(self.probe_interval_s):
            try:
                self._ping()
            except Exception:  # NOTE: unreachable still, or closed under the ping
                continue
            with self._reach_lock:
                down_since, self._down_since = self._down_since, None
            down_s = 0.0 if down_since is None else time.monotonic() - down_since
            log.info("kv_store_reachable", store=self.name, unreachable_s=round(down_s, 2))
            return

    def _stop_probing(self) -> None:
        """Ends a probe in progress (call from `close`)."""
        self._closed.set()

    def _ping(self) -> None:
        """Raises `KvStoreUnavailable` unless the store answers. Only called for a store that
        sets `probe_interval_s`, which overrides it (`RedisKvStore`); the others never probe."""
        raise NotImplementedError(f"{type(self).__name__} sets probe_interval_s without _ping")

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
