"""The ``file:`` KV store: one file per block under a directory, shared by one host's processes.

Layout: ``DIR/<first 2 hex digits of the key>/<64 hex digits>.kv``. A write goes to a private
temp file in the same directory and is renamed over the entry (`os.replace`), so a reader in any
process sees a whole old entry, a whole new one, or none; concurrent writers of one key each
publish a whole entry and the last rename wins.

Size bound: when this process's running total passes ``max_bytes`` it scans the directory and
deletes the entries with the oldest mtime until the total is at most ``low_water`` of the bound.
Reading an entry refreshes its mtime, so the eviction is least-recently-used by mtime. Each
process counts its own writes since its last scan, so with several writers the directory can
overshoot the bound by about one eviction margin per process before one of them scans.
"""

from __future__ import annotations

import errno
import os
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import structlog

from pdserve.kv.store import KvStore, KvStoreFull, KvStoreUnavailable

log = structlog.get_logger(__name__)

_SUFFIX = ".kv"
_TEMP_SUFFIX = ".tmp"
# NOTE: a temp file this old belongs to a writer that died between write and rename.
_STALE_TEMP_S = 600.0
# NOTE: what a write gets from a file system with no room left (for anyone, or for this user).
_NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT})


def _touch(fd: int) -> None:
    # NOTE: the kernel stamps files from a coarse (per-tick) clock; an explicit time keeps the
    # order of writes and reads within one tick, which the eviction order relies on.
    now_ns = time.time_ns()
    os.utime(fd, ns=(now_ns, now_ns))


class _Entry(NamedTuple):
    mtime_ns: int
    nbytes: int
    path: str


class FileKvStore(KvStore):
    """Entries as files under `root` (see the module docstring).

    Args:
        root: The directory (created if missing).
        max_bytes: Upper bound on the bytes of all entries.
        low_water: Fraction of `max_bytes` an eviction brings the total down to.
    """

    def __init__(
        self, root: str | os.PathLike[str], max_bytes: int, low_water: float = 0.9
    ) -> None:
        super().__init__()
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if not 0.0 < low_water <= 1.0:
            raise ValueError(f"low_water must be in (0, 1], got {low_water}")
        self.root = Path(root)
        self.name = f"file:{self.root}"
        self.max_bytes = max_bytes
        self.low_water = low_water
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise KvStoreUnavailable(f"cannot create KV store directory {self.root}: {e}") from e
        self._lock = threading.Lock()
        self._evict_lock = threading.Lock()
        self._num_bytes = sum(e.nbytes for e in self._scan())

    @property
    def num_bytes(self) -> int:
        """This process's estimate of the bytes of all entries."""
        with self._lock:
            return self._num_bytes

    def path_of(self, key: bytes) -> Path:
        """Where the entry of `key` lives."""
        name = key.hex()
        return self.root / name[:2] / (name + _SUFFIX)

    def _put_many(self, entries: Mapping[bytes, bytes]) -> int:
        written = 0
        try:
            for key, blob in entries.items():
                self._write_atomically(self.path_of(key), blob)
                written += len(blob)
        except OSError as e:
            error = KvStoreFull if e.errno in _NO_ROOM else KvStoreUnavailable
            raise error(f"cannot write to KV store {self.root}: {e}") from e
        finally:
            with self._lock:
                self._num_bytes += written
                is_over = self._num_bytes > self.max_bytes
        if is_over:
            self._evict()
        return written

    def _write_atomically(self, path: Path, blob: bytes) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}{_TEMP_SUFFIX}")
        try:
            path.parent.mkdir(exist_ok=True)
            # NOTE: no fsync: this is a cache, and a torn entry after a crash is a checked miss.
            with open(tmp, "wb") as f:
                f.write(blob)
                _touch(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return [self._read(self.path_of(key)) for key in keys]

    def _read(self, path: Path) -> bytes | None:
        try:
            with open(path, "rb") as f:
                blob = f.read()
                # NOTE: refresh through the open descriptor: an eviction may unlink the path.
                _touch(f.fileno())
            return blob
        except FileNotFoundError:
            return None
        except OSError as e:
            raise KvStoreUnavailable(f"cannot read from KV store {self.root}: {e}") from e

    def _contains_prefix(self, keys: Sequence[bytes]) -> int:
        for num_present, key in enumerate(keys):
            if not self.path_of(key).is_file():
                return num_present
        return len(keys)

    def close(self) -> None:
        """Nothing to release: every operation opens and closes its own files."""

    def _scan(self) -> list[_Entry]:
        """Every entry, oldest first; removes stale temp files on the way."""
        entries: list[_Entry] = []
        stale_before_ns = time.time_ns() - int(_STALE_TEMP_S * 1e9)
        for subdir in os.scandir(self.root):
            if not subdir.is_dir():
                continue
            try:
                files = list(os.scandir(subdir.path))
            except FileNotFoundError:
                continue
            for f in files:
                try:
                    st = f.stat()
                except FileNotFoundError:
                    continue
                if f.name.endswith(_SUFFIX):
                    entries.append(_Entry(st.st_mtime_ns, st.st_size, f.path))
                elif f.name.endswith(_TEMP_SUFFIX) and st.st_mtime_ns < stale_before_ns:
                    Path(f.path).unlink(missing_ok=True)
        entries.sort()
        return entries

    def _evict(self) -> None:
        # NOTE: one eviction at a time per process; a thread that finds one running skips it.
        if not self._evict_lock.acquire(blocking=False):
            return
        try:
            entries = self._scan()
            total = sum(e.nbytes for e in entries)
            target = int(self.max_bytes * self.low_water)
            num_evicted = 0
            for entry in entries:
                if total <= target:
                    break
                try:
                    os.unlink(entry.path)
                    num_evicted += 1
                except FileNotFoundError:
                    pass  # another process evicted it first
                total -= entry.nbytes
            with self._lock:
                self._num_bytes = total
            self.stats.add(evictions=num_evicted)
            log.debug("kv_store_evicted", root=str(self.root), num_evicted=num_evicted)
        except OSError as e:
            self.stats.add(errors=1)
            log.warning("kv_store_eviction_failed", root=str(self.root), error=str(e))
        finally:
            self._evict_lock.release()
