"""Opens a KV store from a spec string (the ``--kv-store`` flag):

* ``file:DIR[?max_bytes=N]``: one file per block under DIR, for the processes of one host
  (`pdserve.kv.file_store`).
* ``redis://HOST:PORT[/DB][?ttl_s=N&timeout_s=T]`` (or ``valkey://``): a shared Redis/Valkey
  (`pdserve.kv.redis_store`).

The backends are imported only when a store is opened.
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import parse_qsl, urlsplit

from pdserve.kv.store import KvStore

DEFAULT_FILE_MAX_BYTES = 1 << 30
DEFAULT_REDIS_TIMEOUT_S = 2.0
_KIND_NAMES = {int: "an integer", float: "a number"}


def _number_param(
    params: dict[str, str], name: str, spec: str, kind: type[int] | type[float] = int
) -> int | float | None:
    if name not in params:
        return None
    try:
        value = kind(params.pop(name))
    except ValueError:
        raise ValueError(f"{name} in KV store spec {spec!r} must be {_KIND_NAMES[kind]}") from None
    if value <= 0:
        raise ValueError(f"{name} in KV store spec {spec!r} must be positive, got {value}")
    return value


def open_store(spec: str) -> KvStore:
    """Opens the store a spec names (see the module docstring for the forms).

    Raises:
        ValueError: If the spec is not one of the supported forms, with what is wrong.
        KvStoreUnavailable: If the store exists but cannot be opened.
    """
    return _parse_spec(spec)()


def check_store_spec(spec: str) -> None:
    """Checks a spec's form without opening anything (for config validation).

    Raises:
        ValueError: If the spec is not one of the supported forms, with what is wrong.
    """
    _parse_spec(spec)


def _parse_spec(spec: str) -> Callable[[], KvStore]:
    """A function that opens the store `spec` names (raises ValueError for a bad spec)."""
    scheme, sep, rest = spec.partition(":")
    path, _, query = rest.partition("?")
    try:
        params = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)))
    except ValueError:
        raise ValueError(f"malformed query in KV store spec {spec!r}") from None
    if sep and scheme == "file":
        if not path or path.startswith("//"):
            raise ValueError(f"KV store spec {spec!r} must be file:DIR[?max_bytes=N]")
        max_bytes = int(_number_param(params, "max_bytes", spec) or DEFAULT_FILE_MAX_BYTES)
        _reject_unknown(params, spec)

        def open_file() -> KvStore:
            from pdserve.kv.file_store import FileKvStore

            return FileKvStore(path, max_bytes=max_bytes)

        return open_file
    if sep and scheme in ("redis", "valkey"):
        url = urlsplit(spec)
        try:
            host, port = url.hostname, url.port
        except ValueError:
            host, port = None, None
        db_text = url.path.strip("/") or "0"
        if not host or port is None or not db_text.isdigit():
            raise ValueError(f"KV store spec {spec!r} must be {scheme}://HOST:PORT[/DB]")
        ttl_s = _number_param(params, "ttl_s", spec)
        timeout_s = _number_param(params, "timeout_s", spec, float)
        _reject_unknown(params, spec)

        redis_host, redis_port = host, port

        def open_redis() -> KvStore:
            from pdserve.kv.redis_store import RedisKvStore

            return RedisKvStore(
                redis_host,
                redis_port,
                int(db_text),
                ttl_s=None if ttl_s is None else int(ttl_s),
                timeout_s=timeout_s or DEFAULT_REDIS_TIMEOUT_S,
            )

        return open_redis
    raise ValueError(
        f"unsupported KV store spec {spec!r}: use file:DIR[?max_bytes=N] or "
        "redis://HOST:PORT[/DB] (valkey:// also accepted)"
    )


def _reject_unknown(params: dict[str, str], spec: str) -> None:
    if params:
        raise ValueError(f"unknown parameter(s) {sorted(params)} in KV store spec {spec!r}")
