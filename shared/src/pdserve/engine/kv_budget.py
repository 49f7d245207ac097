"""How many blocks a KV cache gets: a given count, a given byte budget, or a share of the memory
that is free when the cache is allocated.

The automatic size (neither a count nor a budget given) is a fraction of what is available: on
CPU of the host's available RAM (``MemAvailable``, or what the process's cgroup still allows
when that is less), at most `CPU_MAX_BYTES`; on a GPU of the device's free memory once the
weights are loaded, less `GPU_ACTIVATION_MARGIN_BYTES` for activations. A cache placed in a
shared-memory file system also takes at most `SHM_SHARE` of its free space. The result never
exceeds what the engine could hold at once (one longest sequence per sequence slot, plus one)
and is raised to one longest sequence when memory allows. `auto_num_blocks` is the arithmetic;
`size_kv_cache` gathers its inputs.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import NamedTuple

import torch

from pdserve.common.generation import num_blocks_for
from pdserve.engine.config import CacheConfig
from pdserve.engine.kv_cache import KVCacheLayout, num_blocks_for_budget

DEFAULT_CPU_FRACTION = 0.10
DEFAULT_GPU_FRACTION = 0.90
CPU_MAX_BYTES = 4 << 30
GPU_ACTIVATION_MARGIN_BYTES = 512 << 20
SHM_SHARE = 0.5

MEMINFO = Path("/proc/meminfo")
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")


class KvCacheSize(NamedTuple):
    """What `size_kv_cache` chose, and from what.

    Attributes:
        num_blocks: Blocks of the cache.
        source: ``num_blocks`` (given), ``memory_mb`` (a given byte budget) or ``auto``.
        available_bytes: Memory the automatic size was taken from; None when not ``auto``.
        fraction: The share of it the cache might take; None when not ``auto``.
    """

    num_blocks: int
    source: str
    available_bytes: int | None = None
    fraction: float | None = None


def auto_num_blocks(
    block_bytes: int,
    available_bytes: int,
    fraction: float,
    *,
    max_bytes: int | None = None,
    reserve_bytes: int = 0,
    max_blocks: int | None = None,
    min_blocks: int = 1,
) -> int:
    """Blocks of a cache sized from free memory.

    The budget is ``fraction * available_bytes - reserve_bytes``, at most `max_bytes`; the
    blocks it holds, at most `max_blocks`. When that is fewer than `min_blocks`, it is raised
    towards `min_blocks` as far as half the available memory (less the reserve, at most
    `max_bytes`) holds them.

    Args:
        block_bytes: Bytes of one block (all layers, K and V).
        available_bytes: Memory free for the cache and everything else.
        fraction: Share of `available_bytes` the cache takes, in (0, 1].
        max_bytes: Most bytes the cache may take whatever the fraction; None for no limit.
        reserve_bytes: Bytes kept free besides the cache (e.g. for activations).
        max_blocks: Most blocks the engine could ever hold at once; None for no limit.
        min_blocks: Blocks wanted even when the fraction gives fewer (one longest sequence).

    Returns:
        A positive block count.

    Raises:
        ValueError: For bad arguments, or when not even one block fits.
    """
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if available_bytes < 0 or reserve_bytes < 0:
        raise ValueError("available_bytes and reserve_bytes must be >= 0")
    limit = max_bytes if max_bytes is not None else available_bytes
    budget = min(int(available_bytes * fraction) - reserve_bytes, limit)
    num_blocks = max(budget, 0) // block_bytes
    if max_blocks is not None:
        num_blocks = min(num_blocks, max_blocks)
    if num_blocks < min_blocks:
        room = min(available_bytes // 2 - reserve_bytes, limit)
        num_blocks = max(num_blocks, min(min_blocks, max(room, 0) // block_bytes))
    if num_blocks <= 0:
        raise ValueError(
            f"no room for a KV cache: {available_bytes} bytes available, a block takes "
            f"{block_bytes}; give --num-blocks or --kv-cache-memory-mb"
        )
    return num_blocks


def size_kv_cache(
    cache: CacheConfig,
    layout: KVCacheLayout,
    device: torch.device,
    *,
    max_model_len: int,
    max_seqs: int,
) -> KvCacheSize:
    """How many blocks the cache gets: ``cache.num_blocks``, else what ``cache.memory_bytes``
    holds, else a share of the memory free on `device` now (see the module's doc).

    Args:
        cache: The cache settings.
        layout: The block layout (its bytes per block).
        device: Where the cache will live (its free memory is read for the automatic size).
        max_model_len: Longest sequence served.
        max_seqs: Most sequences that hold blocks at once.

    Raises:
        ValueError: When not even one block fits.
    """
    if cache.num_blocks is not None:
        return KvCacheSize(cache.num_blocks, "num_blocks")
    block_bytes = layout.total_block_nbytes
    if cache.memory_bytes is not None:
        num_blocks = num_blocks_for_budget(layout, cache.memory_bytes)
        if num_blocks <= 0:
            raise ValueError(
                f"a KV cache budget of {cache.memory_bytes} bytes holds no block of {block_bytes}"
            )
        return KvCacheSize(num_blocks, "memory_mb")
    blocks_per_seq = num_blocks_for(max_model_len, layout.block_size)
    if device.type == "cuda":
        fraction = cache.memory_fraction or DEFAULT_GPU_FRACTION
        available = device_free_bytes(device)
        max_bytes, reserve = None, GPU_ACTIVATION_MARGIN_BYTES
    else:
        fraction = cache.memory_fraction or DEFAULT_CPU_FRACTION
        available = host_available_bytes()
        max_bytes, reserve = CPU_MAX_BYTES, 0
        shm_free = None if cache.shm_dir is None else free_space_bytes(Path(cache.shm_dir))
        shm_share = None if shm_free is None else int(shm_free * SHM_SHARE)
        # NOTE: a segment too small for one longest sequence is not worth shrinking the cache
        # for: its creation then fails and the decode offers its other transports.
        if shm_share is not None and shm_share >= blocks_per_seq * block_bytes:
            max_bytes = min(max_bytes, shm_share)
    num_blocks = auto_num_blocks(
        block_bytes,
        available,
        fraction,
        max_bytes=max_bytes,
        reserve_bytes=reserve,
        max_blocks=(max_seqs + 1) * blocks_per_seq,
        min_blocks=blocks_per_seq,
    )
    return KvCacheSize(num_blocks, "auto", available, fraction)


def host_available_bytes(
    meminfo: Path = MEMINFO,
    cgroup_root: Path = CGROUP_ROOT,
    proc_self_cgroup: Path = PROC_SELF_CGROUP,
) -> int:
    """RAM available to this process: ``MemAvailable`` (``os.sysconf``'s free pages where
    /proc/meminfo lacks it), or what the process's cgroup still allows when that is less."""
    available = _meminfo_available(meminfo)
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    allowed = cgroup_available_bytes(cgroup_root, proc_self_cgroup)
    return available if allowed is None else min(available, allowed)


def _meminfo_available(meminfo: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                value, *unit = line.split(":", 1)[1].split()
                return int(value) * (1024 if unit == ["kB"] else 1)
    return None


def cgroup_available_bytes(
    cgroup_root: Path = CGROUP_ROOT, proc_self_cgroup: Path = PROC_SELF_CGROUP
) -> int | None:
    """The memory limit of this process's cgroup less its working set (usage less the
    inactive file cache, which the kernel reclaims first), or None without a limit.

    cgroup v2 (``memory.max``, ``memory.current`` and ``memory.stat`` in the process's own
    cgroup, else at the root, which is the container's own inside one) or v1 (the ``memory/``
    controller's ``memory.limit_in_bytes``, ``memory.usage_in_bytes`` and ``memory.stat``).
    """
    directories = []
    with contextlib.suppress(OSError):
        for line in proc_self_cgroup.read_text().splitlines():
            if line.startswith("0::/"):
                directories.append(cgroup_root / line[4:].strip())
    directories.append(cgroup_root)
    for directory in directories:
        available = _limit_less_usage(
            directory / "memory.max", directory / "memory.current", directory / "memory.stat"
        )
        if available is not None:
            return available
    v1 = cgroup_root / "memory"
    return _limit_less_usage(
        v1 / "memory.limit_in_bytes", v1 / "memory.usage_in_bytes", v1 / "memory.stat"
    )


def _limit_less_usage(limit_path: Path, usage_path: Path, stat_path: Path) -> int | None:
    try:
        limit_text = limit_path.read_text().strip()
        if limit_text == "max":
            return None
        limit = int(limit_text)
        # NOTE: cgroup v1 writes "no limit" as a huge number (a page-rounded 2**63 - 1).
        if limit >= 1 << 60:
            return None
        usage = int(usage_path.read_text().strip())
    except (OSError, ValueError):
        return None
    stat: dict[str, str] = {}
    with contextlib.suppress(OSError):
        stat = dict(line.partition(" ")[::2] for line in stat_path.read_text().splitlines())
    # NOTE: v1's inactive_file is the cgroup's own, total_inactive_file its subtree's.
    try:
        inactive_file = int(stat.get("total_inactive_file", stat.get("inactive_file", "0")))
    except ValueError:
        inactive_file = 0
    return max(limit - max(usage - inactive_file, 0), 0)


def free_space_bytes(directory: Path) -> int | None:
    """Free bytes of the file system holding `directory` (e.g. /dev/shm); None if unknown."""
    try:
        stats = os.statvfs(directory)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def device_free_bytes(device: torch.device) -> int:
    """Free memory of a CUDA device (what the caching allocator holds unused is returned
    first)."""
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)
