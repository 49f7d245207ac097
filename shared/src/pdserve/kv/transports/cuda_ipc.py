"""The cuda_ipc KV transport's handle: a decode's KV cache exported once, so that a process on
the same host can map it and write a lease's blocks into it in place.

The decode exports its cache once (`export_cache`) and advertises the `CacheHandle` in every lease
(`TRANSPORT_KIND_CUDA_IPC` in decode.proto); a prefill maps it once per decode (`open_cache`, cached
by `pdserve.kv.transports.cuda_ipc_window.MappedCaches`). Two kinds of memory follow the same
exchange:

* CUDA: torch's CUDA storage sharing. The export is the cache storage's ``_share_cuda_()``
  (the allocation's cudaIpcMemHandle, the storage's offset in it and torch's shared reference
  counter); the import is ``UntypedStorage._new_shared_cuda``, as
  `torch.multiprocessing.reductions.rebuild_cuda_tensor` does. Runs only with a GPU.
* CPU, the stand-in that rehearses the exchange without a GPU: the cache in a shared-memory
  segment (`pdserve.kv.transports.shm.KvSegment`), its name as the memory handle. Offered only when
  enabled (`pdserve.common.env.kv_ipc_standin`).

Whoever maps the cache can write anywhere in it: a handle travels only inside Lease messages,
over the authenticated plane, and the stand-in's segment is private to the decode's user.
"""

from __future__ import annotations

import contextlib
import os
import socket
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.engine.kv_cache import KVCache, KVCacheLayout
from pdserve.kv.transports.shm import SHM_DIR, KvSegment, SharedKvPool

BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")


class CacheUnavailable(Exception):
    """The handle cannot be opened here (another host, a gone decode, no CUDA, a bad handle)."""


@dataclass(frozen=True)
class CacheHandle:
    """A decode's exported KV cache (the KvCacheHandle message without protobuf).

    Attributes:
        host_id: The decode's host (its kernel boot id).
        process_id: The decode's process id on that host.
        device_kind: ``"cuda:<GPU name>"`` or ``"cpu"`` (the stand-in).
        memory_handle: CUDA: the allocation's cudaIpcMemHandle; CPU: the segment's name.
        device_index: CUDA: the allocation's device on the decode's host.
        offset_bytes: CUDA: where the cache starts in the allocation.
        num_bytes: Size of the cache.
        ref_counter_handle: CUDA: torch's reference-counter file of the allocation.
        ref_counter_offset: CUDA: the counter's offset in that file.
    """

    host_id: str
    process_id: int
    device_kind: str
    memory_handle: bytes
    device_index: int = 0
    offset_bytes: int = 0
    num_bytes: int = 0
    ref_counter_handle: bytes = b""
    ref_counter_offset: int = 0

    @property
    def is_cuda(self) -> bool:
        """Whether the cache is in CUDA device memory (else the CPU stand-in)."""
        return self.device_kind.startswith("cuda")


@dataclass(frozen=True)
class CacheExport:
    """The decode's side of an export: the handle to advertise and what must outlive it.

    Attributes:
        handle: What every lease's cuda_ipc transport carries.
        segment: The stand-in's segment (None on CUDA); removed when the decode stops.
        storage: CUDA: the shared storage (kept referenced while the decode runs).
    """

    handle: CacheHandle
    segment: KvSegment | None = None
    storage: object | None = None


def host_id() -> str:
    """This host's identity as handles carry it: the kernel's boot id (the host name where
    the kernel has none)."""
    with contextlib.suppress(OSError):
        return BOOT_ID_PATH.read_text().strip()
    return socket.gethostname()


def device_kind(device: torch.device) -> str:
    """What kind of memory a cache on `device` lives in: ``"cuda:<GPU name>"`` or ``"cpu"``."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def export_cache(
    kv_cache: KVCache, segment: KvSegment | None = None, directory: Path = SHM_DIR
) -> CacheExport:
    """Exports `kv_cache` for writers on this host (once per decode).

    Args:
        kv_cache: The decode's cache: on CUDA, or on CPU for the stand-in.
        segment: CPU: the cache's segment when the shared-memory transport created it already
            (the stand-in then names the same segment); a new one is created otherwise.
        directory: CPU: where a new segment goes.

    Raises:
        ValueError: The cache cannot be exported (not one whole storage, an unknown device).
        OSError: CPU: the segment cannot be created.
    """
    if kv_cache.device.type == "cuda":
        return _export_cuda(kv_cache)
    if kv_cache.device.type != "cpu":
        raise ValueError(f"a KV cache on {kv_cache.device} cannot be exported")
    if segment is None:
        segment = KvSegment.create(kv_cache, directory)
    handle = CacheHandle(
        host_id(), os.getpid(), "cpu", segment.name.encode(), num_bytes=kv_cache.nbytes
    )
    return CacheExport(handle, segment=segment)


def _export_cuda(kv_cache: KVCache) -> CacheExport:
    kv = kv_cache.kv
    if not kv.is_contiguous() or kv.storage_offset() != 0:
        raise ValueError("a CUDA KV cache must be one whole contiguous storage to be exported")
    storage = kv.untyped_storage()
    if storage.nbytes() != kv_cache.nbytes:
        raise ValueError("the CUDA KV cache's storage holds more than the cache")
    # NOTE: the event handle is left out: the cache was written once at allocation, and every
    # later write into leased blocks is ordered by the transfer's own messages.
    device, memory_handle, num_bytes, offset_bytes, ref_handle, ref_offset, _, _ = (
        storage._share_cuda_()
    )
    handle = CacheHandle(
        host_id(),
        os.getpid(),
        device_kind(kv.device),
        bytes(memory_handle),
        device_index=int(device),
        offset_bytes=int(offset_bytes),
        num_bytes=int(num_bytes),
        ref_counter_handle=bytes(ref_handle),
        ref_counter_offset=int(ref_offset),
    )
    return CacheExport(handle, storage=storage)


class OpenedCache:
    """A peer's cache mapped into this process.

    Attributes:
        kv: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` over the peer's
            memory, in the layout's dtype.
        keep: What holds the mapping (released with this object).
    """

    def __init__(self, kv: torch.Tensor, keep: object) -> None:
        self.kv = kv
        self.keep = keep


def open_cache(
    handle: CacheHandle, layout: KVCacheLayout, directory: Path = SHM_DIR
) -> OpenedCache:
    """Maps the cache `handle` names (CUDA IPC, or the CPU stand-in's segment).

    Raises:
        CacheUnavailable: It cannot be mapped here: the decode is on another host or gone, this
            process has no CUDA, the handle is malformed or its size does not fit `layout`.
    """
    per_block = 2 * layout.num_layers * layout.block_nbytes
    if handle.num_bytes <= 0 or handle.num_bytes % per_block:
        raise CacheUnavailable(f"a cache of {handle.num_bytes} bytes is not whole KV blocks")
    if handle.host_id != host_id():
        raise CacheUnavailable("the cache is on another host")
    try:
        if handle.is_cuda:
            storage = _open_cuda(handle)
            flat = torch.empty(0, dtype=torch.uint8, device=storage.device)
            flat.set_(storage, 0, (handle.num_bytes,), (1,))
            keep: object = storage
        else:
            pool = SharedKvPool(handle.memory_handle.decode(), layout, directory)
            if len(pool.mapping) != handle.num_bytes:
                raise ValueError(f"{pool.name} holds {len(pool.mapping)} bytes")
            flat = _frombuffer(pool.mapping, handle.num_bytes)
            keep = pool
    except (OSError, ValueError, RuntimeError, UnicodeDecodeError) as error:
        raise CacheUnavailable(str(error)) from None
    shape = layout.cache_shape(handle.num_bytes // per_block)
    return OpenedCache(flat.view(getattr(torch, layout.dtype)).view(shape), keep)


def _open_cuda(handle: CacheHandle) -> torch.UntypedStorage:
    if not torch.cuda.is_available():
        raise RuntimeError("this process has no CUDA")
    torch.cuda._lazy_init()
    return torch.UntypedStorage._new_shared_cuda(
        handle.device_index,
        handle.memory_handle,
        handle.num_bytes,
        handle.offset_bytes,
        handle.ref_counter_handle,
        handle.ref_counter_offset,
        b"",
        False,
    )


def _frombuffer(buffer: object, num_bytes: int) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buffer, dtype=torch.uint8, count=num_bytes)
