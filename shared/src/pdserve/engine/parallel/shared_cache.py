"""The KV cache of a tensor-parallel instance on CPU: one shared-memory file, every rank's
heads in it.

Rank 0 creates the cache in a file under /dev/shm with the layout of a single-process cache
(all KV heads); every rank maps it and attends over a view of its own heads (or its replica of
one head). Rank 0 therefore always sees whole blocks: exporting, importing and the decode's
shared-memory segment work as without tensor parallelism, and a prefill and a decode of
different tensor-parallel sizes exchange the same bytes.
"""

from __future__ import annotations

import math
import mmap
import os
import secrets
import warnings
from collections.abc import Sequence
from pathlib import Path

import structlog
import torch

from pdserve.common.stale_files import remove_orphaned_files
from pdserve.engine.kv_cache import KVCache, KVCacheLayout

log = structlog.get_logger(__name__)

NAME_PREFIX = "pdserve-tp-kv-"
DEFAULT_DIR = Path("/dev/shm")


def _map(path: Path, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        # NOTE: the tensor holds a reference to the mapping; it is unmapped with the tensor.
        flat = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
    return flat.view(dtype)


def create_shared_cache(
    layout: KVCacheLayout,
    num_blocks: int,
    directory: Path = DEFAULT_DIR,
    window_layers: Sequence[int] = (),
    num_window_slots: int = 0,
) -> KVCache:
    """A CPU cache of all heads in a new private file (rank 0); `KVCache.shared_path` names it.
    With `window_layers`, those layers keep their KV in `num_window_slots` window slots after
    the other layers' blocks (`pdserve.engine.window_slots`), as in a decode's segment.

    Its pages are taken on first write, like a single-process cache's. The caller removes the
    file (`remove_shared_cache`) when the instance ends.
    """
    remove_stale_files(directory)
    path = directory / f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    nbytes = _file_bytes(layout, num_blocks, window_layers, num_window_slots)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    cache = _mapped_cache(path, layout, num_blocks, window_layers, num_window_slots)
    cache.shared_path = path
    log.info("tensor_parallel_cache_created", name=path.name, num_bytes=nbytes)
    return cache


def _file_bytes(
    layout: KVCacheLayout, num_blocks: int, window_layers: Sequence[int], num_window_slots: int
) -> int:
    per_layer_block = layout.total_block_nbytes // layout.num_layers
    num_full = layout.num_layers - len(window_layers)
    return per_layer_block * (num_full * num_blocks + len(window_layers) * num_window_slots)


def _mapped_cache(
    path: Path,
    layout: KVCacheLayout,
    num_blocks: int,
    window_layers: Sequence[int],
    num_window_slots: int,
) -> KVCache:
    """The whole cache in the file: the blocks' storage, then the window slots' (if any)."""
    nbytes = _file_bytes(layout, num_blocks, window_layers, num_window_slots)
    flat = _map(path, nbytes, getattr(torch, layout.dtype))
    num_full = layout.num_layers - len(window_layers)
    shape = (num_full, *layout.cache_shape(num_blocks)[1:])
    kv = flat[: math.prod(shape)].view(shape)
    if not window_layers:
        return KVCache(layout, num_blocks, torch.device("cpu"), kv=kv)
    window_shape = (len(window_layers), *layout.cache_shape(num_window_slots)[1:])
    return KVCache(
        layout,
        num_blocks,
        torch.device("cpu"),
        kv=kv,
        window_layers=window_layers,
        num_window_slots=num_window_slots,
        window_kv=flat[math.prod(shape) :].view(window_shape),
    )


def attach_head_slice(
    path: Path,
    layout: KVCacheLayout,
    num_blocks: int,
    heads: range,
    window_layers: Sequence[int] = (),
    num_window_slots: int = 0,
) -> KVCache:
    """A rank's view of the shared cache file: only its `heads` (`head_slice`); `layout` is
    the whole cache's. With window layers, its slot table is its own: each step brings the
    slots of its blocks (`Step.slots`)."""
    cache = _mapped_cache(path, layout, num_blocks, window_layers, num_window_slots)
    return head_slice(cache, heads)


def head_slice(cache: KVCache, heads: range) -> KVCache:
    """A view of `heads` of every block of `cache` (no copy): the cache a rank attends over
    (sharing `cache`'s window slots, if any).

    Returns:
        A cache whose layout has ``len(heads)`` KV heads and whose tensor is a strided view:
        ``[num_layers, 2, num_blocks, block_size, len(heads), head_dim]``.
    """
    layout = cache.layout
    local = KVCacheLayout(
        num_layers=layout.num_layers,
        num_kv_heads=len(heads),
        head_dim=layout.head_dim,
        block_size=layout.block_size,
        dtype=layout.dtype,
    )
    kv = cache.kv.narrow(4, heads.start, len(heads))
    if cache.window_slots is None:
        return KVCache(local, cache.num_blocks, cache.device, kv=kv)
    return KVCache(
        local,
        cache.num_blocks,
        cache.device,
        kv=kv,
        window_layers=cache.window_layers,
        num_window_slots=cache.window_slots.num_slots,
        window_kv=cache.window_kv.narrow(4, heads.start, len(heads)),
        window_slots=cache.window_slots,
    )


def remove_shared_cache(cache: KVCache) -> None:
    """Removes the cache's file (the ranks keep their mappings while they live)."""
    if cache.shared_path is not None:
        cache.shared_path.unlink(missing_ok=True)


def remove_stale_files(directory: Path = DEFAULT_DIR) -> int:
    """Removes this user's cache files left by instances that no longer run; returns how many."""
    return remove_orphaned_files(directory, NAME_PREFIX)
