"""The one place where pdserve reads environment variables.

Every setting that may come from the environment has a named constant and a small function
here, so the rest of the code takes plain values (paths, numbers) and never calls
`os.environ` itself.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_CACHE_DIR = "PDSERVE_CACHE_DIR"
"""Directory for generated artifacts such as the demo model."""

DEFAULT_CACHE_DIR = Path("~/.cache/pdserve")


def cache_dir() -> Path:
    """Returns the pdserve cache directory.

    It is ``$PDSERVE_CACHE_DIR`` when that variable is set and not empty, otherwise
    ``~/.cache/pdserve``. The directory is not created here.

    Returns:
        An absolute path with ``~`` expanded.
    """
    value = os.environ.get(ENV_CACHE_DIR, "").strip()
    path = Path(value) if value else DEFAULT_CACHE_DIR
    return path.expanduser().absolute()


ENV_OTLP_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
ENV_OTLP_TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
ENV_TRACES_EXPORTER = "OTEL_TRACES_EXPORTER"


def otlp_traces_endpoint() -> str | None:
    """The OTLP endpoint that the standard OpenTelemetry variables ask traces to go to.

    Returns ``None`` (tracing off) when ``OTEL_TRACES_EXPORTER`` is ``none`` or no endpoint is
    set; ``OTEL_TRACES_EXPORTER=otlp`` alone means the OTLP default ``localhost:4317``.
    """
    exporter = os.environ.get(ENV_TRACES_EXPORTER, "").strip().lower()
    if exporter == "none":
        return None
    endpoint = (
        os.environ.get(ENV_OTLP_TRACES_ENDPOINT, "").strip()
        or os.environ.get(ENV_OTLP_ENDPOINT, "").strip()
    )
    if endpoint:
        return endpoint
    return "localhost:4317" if exporter == "otlp" else None


ENV_FAULT_CORRUPT_KV = "PDSERVE_FAULT_CORRUPT_KV"
"""Fault injection for chaos tests: corrupt the KV of matching requests (off when unset)."""


def fault_corrupt_kv() -> str | None:
    """The request-id pattern whose KV a prefill corrupts on purpose, or ``None`` (off).

    ``$PDSERVE_FAULT_CORRUPT_KV`` is an `fnmatch` pattern over request ids (``*`` matches every
    request). For each matching request the prefill flips one byte of the first KV chunk it
    ships after computing the chunk's checksum, so the decode must refuse the transfer. Unset
    or empty (the default) turns the fault off.
    """
    value = os.environ.get(ENV_FAULT_CORRUPT_KV, "").strip()
    return value or None


ENV_API_KEYS = "PDSERVE_API_KEYS"
"""API keys the gateway accepts, as ``name:key`` entries (see `pdserve.gateway.access.api_keys`)."""


def api_keys() -> str | None:
    """The gateway's ``$PDSERVE_API_KEYS`` (entries separated by ``,`` or newlines), or ``None``.

    Unset or blank means no keys come from the environment.
    """
    value = os.environ.get(ENV_API_KEYS, "")
    return value if value.strip() else None


ENV_KV_IPC_STANDIN = "PDSERVE_KV_IPC_STANDIN"
"""Tests only: a decode with a CPU KV cache offers the cuda_ipc transport through its CPU
stand-in (off when unset)."""


def kv_ipc_standin() -> bool:
    """Whether a decode whose KV cache is on CPU offers cuda_ipc through the CPU stand-in.

    ``$PDSERVE_KV_IPC_STANDIN`` set to ``1`` (or ``true``/``yes``) turns it on: the decode
    exports its shared-memory segment as a cuda_ipc cache handle, so that the handle exchange,
    the fallback and the commit of that transport run without a GPU. Unset (the default), only
    a CUDA cache offers cuda_ipc.
    """
    return os.environ.get(ENV_KV_IPC_STANDIN, "").strip().lower() in ("1", "true", "yes")
