"""The gateway's API keys: named, from three sources, the key file re-read when it changes.

Keys come from ``--api-key KEY`` (named ``default``), ``$PDSERVE_API_KEYS`` and
``--api-key-file PATH``; with none of the three the gateway is open. An entry is ``NAME:KEY``,
optionally with limits of its own: ``NAME:KEY:rpm=60:concurrency=4``. In the file there is one
entry per line (blank lines and ``#`` comments are skipped); in the variable, entries are
separated by ``,`` or newlines. A name is a short identifier (letters, digits, ``_ . -``, at
most 64 characters): logs, spans and the per-key limits use it. A key is any run of characters
other than whitespace, ``,`` and ``:``. The store keeps only each key's SHA-256 digest, so no
key can reach a log line, and an error about an entry names its line, never its text.

`ApiKeyStore` re-reads the file when its modification time, size or inode changes, looking at
most once per `reload_interval_s` as requests arrive. A file that no longer parses (or is gone)
leaves the last good set in place and logs ``api_key_file_invalid``; a key removed from a good
file is refused from the next look on.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import structlog

log = structlog.get_logger("pdserve.gateway.access.api_keys")

DEFAULT_KEY_NAME = "default"
ENTRY_FORMAT = "NAME:KEY[:rpm=N][:concurrency=N]"
RELOAD_INTERVAL_S = 1.0
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_KEY = re.compile(r"[^\s,:]+")


def key_digest(key: str) -> bytes:
    """What the store keeps of a key: its SHA-256 digest (one length for every key)."""
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class ApiKey:
    """One accepted key.

    Attributes:
        name: What logs, spans and the per-key limits call it.
        digest: SHA-256 of the key (`key_digest`); the key itself is not kept.
        requests_per_minute: Its own rate limit (``rpm=``), or None for the gateway's.
        max_concurrent_requests: Its own concurrency limit (``concurrency=``), or None for the
            gateway's.
    """

    name: str
    digest: bytes = field(repr=False)
    requests_per_minute: float | None = None
    max_concurrent_requests: int | None = None


def parse_entry(entry: str, where: str) -> ApiKey:
    """One ``NAME:KEY[:rpm=N][:concurrency=N]`` entry.

    Raises:
        ValueError: Naming `where` (e.g. "keys.txt line 3") and what is wrong, never the entry.
    """
    name, colon, rest = entry.strip().partition(":")
    key, _, options = rest.partition(":")
    # NOTE: without a colon the whole entry may be a key: nothing of it goes into the message.
    if not colon or not _NAME.fullmatch(name):
        raise ValueError(
            f"{where}: expected {ENTRY_FORMAT} with a NAME of letters, digits, '_', '.' and '-' "
            "(at most 64 characters)"
        )
    if not _KEY.fullmatch(key):
        raise ValueError(
            f"{where}: the key of {name!r} is empty or has whitespace, ',' or ':' in it"
        )
    limits: dict[str, float] = {}
    for option in options.split(":") if options else ():
        option_name, _, value = option.partition("=")
        if option_name not in ("rpm", "concurrency") or option_name in limits:
            raise ValueError(f"{where}: unknown or repeated option; expected {ENTRY_FORMAT}")
        try:
            number = float(value) if option_name == "rpm" else int(value)
        except ValueError:
            number = 0
        if not (math.isfinite(number) and number > 0):
            raise ValueError(f"{where}: {option_name} of {name!r} must be a positive number")
        limits[option_name] = number
    concurrency = limits.get("concurrency")
    return ApiKey(
        name, key_digest(key), limits.get("rpm"), None if concurrency is None else int(concurrency)
    )


def parse_api_keys(text: str, source: str, *, separators: str = "\n") -> tuple[ApiKey, ...]:
    """The entries of a key file (one a line) or of ``$PDSERVE_API_KEYS`` (``separators=",\\n"``).

    Blank entries and entries starting with ``#`` are skipped.

    Raises:
        ValueError: For the first malformed entry, naming `source` and its line (or entry)
            number; for a name or key given twice.
    """
    unit = "line" if separators == "\n" else "entry"
    keys = []
    for number, entry in enumerate(re.split(f"[{re.escape(separators)}]", text), 1):
        entry = entry.strip()
        if entry and not entry.startswith("#"):
            keys.append(parse_entry(entry, f"{source} {unit} {number}"))
    return check_unique(tuple(keys), source)


def check_unique(keys: tuple[ApiKey, ...], source: str) -> tuple[ApiKey, ...]:
    """`keys`, if no name and no key appears twice.

    Raises:
        ValueError: Naming the repeated name (or the two names sharing one key).
    """
    by_name: dict[str, ApiKey] = {}
    by_digest: dict[bytes, str] = {}
    for key in keys:
        if key.name in by_name:
            raise ValueError(f"{source}: the key name {key.name!r} is given twice")
        if key.digest in by_digest:
            raise ValueError(
                f"{source}: {by_digest[key.digest]!r} and {key.name!r} have the same key"
            )
        by_name[key.name] = key
        by_digest[key.digest] = key.name
    return keys


class _FileSignature(NamedTuple):
    mtime_ns: int
    size: int
    inode: int


def _signature(path: Path) -> _FileSignature:
    stat = os.stat(path)
    return _FileSignature(stat.st_mtime_ns, stat.st_size, stat.st_ino)


class ApiKeyStore:
    """The keys the gateway accepts now.

    Args:
        static_keys: Keys of ``--api-key`` and ``$PDSERVE_API_KEYS`` (never re-read).
        key_file: ``--api-key-file``, re-read when it changes; None without one.
        reload_interval_s: Least time between two looks at the key file.
        clock: Monotonic seconds.

    Raises:
        ValueError: When the key file cannot be read or parsed at start, or a name or key is
            given twice across the sources.
    """

    def __init__(
        self,
        static_keys: tuple[ApiKey, ...] = (),
        key_file: Path | None = None,
        *,
        reload_interval_s: float = RELOAD_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._static_keys = static_keys
        self._key_file = key_file
        self._reload_interval_s = reload_interval_s
        self._clock = clock
        self._checked_at = clock()
        self._signature: _FileSignature | None = None
        self._keys = check_unique(static_keys, "API keys")
        if key_file is not None:
            try:
                signature = _signature(key_file)
                self._keys = self._load(key_file)
            except OSError as exc:
                raise ValueError(f"--api-key-file {key_file}: {_reason(exc)}") from None
            self._signature = signature

    @classmethod
    def from_settings(
        cls, api_key: str | None, api_key_file: str | None, env_keys: str | None
    ) -> ApiKeyStore:
        """The store for ``--api-key``, ``--api-key-file`` and ``$PDSERVE_API_KEYS``."""
        static: tuple[ApiKey, ...] = ()
        if api_key is not None:
            static += (ApiKey(DEFAULT_KEY_NAME, key_digest(api_key)),)
        if env_keys is not None:
            static += parse_api_keys(env_keys, "PDSERVE_API_KEYS", separators=",\n")
        return cls(static, None if api_key_file is None else Path(api_key_file))

    @property
    def is_open(self) -> bool:
        """Whether no key is configured anywhere (every request is accepted).

        A key file with no entries is not open: it accepts no key at all.
        """
        return not self._static_keys and self._key_file is None

    @property
    def names(self) -> tuple[str, ...]:
        """Names of the keys accepted now."""
        return tuple(key.name for key in self._keys)

    def match(self, presented: str) -> ApiKey | None:
        """The key whose value is `presented`, or None (the file re-read first if it is due)."""
        self._reload_if_changed()
        digest = key_digest(presented)
        found = None
        for key in self._keys:
            # NOTE: every key is compared (equal-length digests, constant-time compare), so the
            # time taken does not tell which key matched, or whether one did.
            if hmac.compare_digest(digest, key.digest) and found is None:
                found = key
        return found

    def _load(self, path: Path) -> tuple[ApiKey, ...]:
        source = f"--api-key-file {path}"
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{source}: not UTF-8 text") from None
        return check_unique(self._static_keys + parse_api_keys(text, source), "API keys")

    def _reload_if_changed(self) -> None:
        path = self._key_file
        now = self._clock()
        if path is None or now - self._checked_at < self._reload_interval_s:
            return
        self._checked_at = now
        # NOTE: a stat (and, when it changed, a read of a small file) on the event loop: cheap,
        # and at most once per interval. Each change is logged once, good or bad.
        try:
            signature = _signature(path)
            if signature == self._signature:
                return
            self._signature = signature
            keys = self._load(path)
        except (OSError, ValueError) as exc:
            if isinstance(exc, OSError):
                if self._signature == _MISSING:
                    return
                self._signature = _MISSING
            log.error("api_key_file_invalid", path=str(path), error=_reason(exc), kept=self.names)
            return
        self._keys = keys
        log.info("api_keys_reloaded", path=str(path), names=self.names)


_MISSING = _FileSignature(-1, -1, -1)


def _reason(exc: OSError | ValueError) -> str:
    if isinstance(exc, OSError):
        return exc.strerror or type(exc).__name__
    return str(exc)
