"""An instance's KV storage tier (``--kv-store``): the store, its writer and its counters.

`open_kv_tier` opens the store once at start and pairs it with the `KvStoreWriter` that
writes to it; without ``--kv-store``, or when the store cannot be opened, both are None and
every store operation is skipped. `kv_store_counters` exports the store's `KvStoreStats` as
the role's Prometheus counters.
"""

from __future__ import annotations

from typing import NamedTuple

import structlog

from pdserve.kv.codec import MissCause
from pdserve.kv.offload import KvStoreWriter
from pdserve.kv.store import KvStore, KvStoreUnavailable
from pdserve.kv.stores import open_store
from pdserve.serving.config import InstanceConfig

log = structlog.get_logger(__name__)


class KvTier(NamedTuple):
    """The opened store and its writer; both None without a store."""

    store: KvStore | None
    writer: KvStoreWriter | None


def open_kv_tier(config: InstanceConfig, fingerprint: str) -> KvTier:
    """Opens ``--kv-store`` (`open_kv_store`) and makes its writer (not started yet).

    Args:
        config: The instance's settings (``--kv-store``, ``--kv-store-queue-len``).
        fingerprint: The KV layout fingerprint the writer stamps entries with.
    """
    store = open_kv_store(config)
    if store is None:
        return KvTier(None, None)
    return KvTier(store, KvStoreWriter(store, fingerprint, config.kv_store_queue_len))


def open_kv_store(config: InstanceConfig) -> KvStore | None:
    """Opens ``--kv-store`` (None without one). A store that cannot be opened now is logged
    and left out: the instance serves without it (every load misses, nothing is offloaded)."""
    if config.kv_store is None:
        return None
    try:
        store = open_store(config.kv_store)
    except KvStoreUnavailable as error:
        log.warning("kv_store_unavailable", spec=config.kv_store, error=str(error))
        return None
    log.info("kv_store_opened", spec=config.kv_store)
    return store


def kv_store_counters(store: KvStore | None, block_size: int) -> dict[str, tuple[str, float]]:
    """The store's `KvStoreStats` as role counters (``kv_store_*``); empty without a store."""
    if store is None:
        return {}
    stats = store.stats.snapshot()
    num_missed = sum(stats.num_misses.values())
    counters: dict[str, tuple[str, float]] = {
        "kv_store_hit_blocks": ("Blocks loaded from the KV store.", stats.num_hits),
        "kv_store_hit_tokens": (
            "Tokens in blocks loaded from the KV store.",
            stats.num_hits * block_size,
        ),
        "kv_store_miss_tokens": (
            "Tokens in blocks looked up in the KV store and not loaded (any cause).",
            num_missed * block_size,
        ),
        "kv_store_stored_bytes": ("Entry bytes written to the KV store.", stats.num_bytes_stored),
        "kv_store_loaded_bytes": ("Entry bytes read from the KV store.", stats.num_bytes_loaded),
        "kv_store_errors": (
            "KV store operations that failed (store down, full or refusing).",
            stats.num_errors,
        ),
        "kv_store_unreachable": (
            "Times the KV store was found unreachable (then skipped until a probe reached it).",
            stats.num_unreachable,
        ),
        "kv_store_full": (
            "Times the KV store was found full (then writes failed until one found room).",
            stats.num_full,
        ),
        "kv_store_skipped_ops": (
            "KV store operations not tried because the store was unreachable.",
            stats.num_skipped,
        ),
        "kv_store_evictions": (
            "Entries the KV store evicted to stay in bounds.",
            stats.num_evictions,
        ),
        "kv_store_get_seconds": ("Seconds spent reading the KV store.", stats.get_seconds),
        "kv_store_put_seconds": ("Seconds spent writing the KV store.", stats.put_seconds),
    }
    for cause in MissCause:
        counters[f"kv_store_miss_blocks_{cause.value}"] = (
            f"Blocks looked up in the KV store and not loaded: {cause.value}.",
            stats.num_misses.get(cause, 0),
        )
    return counters
