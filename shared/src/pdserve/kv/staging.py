"""KV between a device cache and the host through staging buffers, both ways.

Receiving (`HostStaging`): a KV cache in device memory cannot be the target of ``recv_into``:
each chunk is read into a host buffer (pinned on CUDA, from torch's caching host allocator, so
buffers are reused once their copy finished) and copied into its blocks on a side stream
without waiting, so that the copy of one chunk overlaps the read of the next.
`StagedChunk.wait` returns once a chunk's copy landed (before its blocks are checksummed in the
cache). On a CPU cache the same steps run with plain buffers and an immediate copy, which is
how they are tested without a GPU.

Sending (`export_to_host`): one layer's pieces copied from a device cache into pinned host
buffers, all queued and then waited for once, on the engine thread as the layer finishes;
the pieces of the layers before are meanwhile being sent from worker threads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pdserve.engine.kv_cache import KVBlockData, KVCache

# Fills a buffer with the next bytes of a transfer (a socket's recv_into loop).
Filler = Callable[[memoryview], None]


class StagedChunk:
    """One chunk's copy into the cache, possibly still under way."""

    def __init__(self, done: torch.cuda.Event | None) -> None:
        self._done = done

    def wait(self) -> None:
        """Returns once the chunk is in the cache."""
        if self._done is not None:
            self._done.synchronize()


class HostStaging:
    """Reads chunks into host buffers and copies them into a device cache's blocks.

    Args:
        kv_cache: The receiving cache (on CUDA, or on CPU where it runs the same steps).
    """

    def __init__(self, kv_cache: KVCache) -> None:
        self.kv_cache = kv_cache
        self.is_cuda = kv_cache.device.type == "cuda"
        self._stream = torch.cuda.Stream(kv_cache.device) if self.is_cuda else None

    def fill(self, layer_index: int, block_ids: Sequence[int], fill: Filler) -> StagedChunk:
        """Reads K of `block_ids` then V (the chunk layout) with `fill` into a host buffer and
        queues their copy into those blocks of layer `layer_index`.

        Raises:
            Whatever `fill` raises (the blocks are then left as they were or partly written;
            the transfer fails and they are never committed).
        """
        num_bytes = len(block_ids) * self.kv_cache.layout.block_nbytes
        # buffer: [2 * num_bytes] K then V, host memory
        buffer = torch.empty(2 * num_bytes, dtype=torch.uint8, pin_memory=self.is_cuda)
        view = buffer.numpy().data.cast("B")
        fill(view[:num_bytes])
        fill(view[num_bytes:])
        block_ids = self.kv_cache.physical_blocks(layer_index, block_ids)
        k_cache, v_cache = self.kv_cache.layer(layer_index)
        shape = (len(block_ids), *k_cache.shape[1:])
        if self._stream is None:
            self._copy(buffer, num_bytes, shape, block_ids, (k_cache, v_cache))
            return StagedChunk(None)
        done = torch.cuda.Event()
        with torch.cuda.stream(self._stream):
            self._copy(buffer, num_bytes, shape, block_ids, (k_cache, v_cache))
            done.record(self._stream)
        return StagedChunk(done)

    def _copy(
        self,
        buffer: torch.Tensor,
        num_bytes: int,
        shape: tuple[int, ...],
        block_ids: Sequence[int],
        caches: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        device = self.kv_cache.device
        index = torch.tensor(block_ids, dtype=torch.long, device=device)
        for part, cache in enumerate(caches):
            # source: [num_blocks, block_size, num_kv_heads, head_dim] in host memory
            source = buffer[part * num_bytes : (part + 1) * num_bytes]
            source = source.view(self.kv_cache.dtype).view(shape)
            cache.index_copy_(0, index, source.to(device, non_blocking=True))


def export_to_host(
    kv_cache: KVCache, layer_index: int, pieces: Sequence[Sequence[int]], *, pin: bool = True
) -> list[KVBlockData]:
    """The K and V bytes of each run of blocks in `pieces` of one layer of a device cache (the
    layout of `KVCache.export_blocks`), in host buffers (pinned where `pin`), once every copy
    landed."""
    k_cache, v_cache = kv_cache.layer(layer_index)
    copies = []
    for block_ids in pieces:
        block_ids = kv_cache.physical_blocks(layer_index, block_ids)
        index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
        pair = []
        for cache in (k_cache, v_cache):
            # blocks: [num_blocks, block_size, num_kv_heads, head_dim] gathered on the device
            blocks = cache.index_select(0, index)
            host = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=pin)
            host.copy_(blocks, non_blocking=pin)
            pair.append(host)
        copies.append(pair)
    if kv_cache.device.type == "cuda":
        torch.cuda.current_stream(kv_cache.device).synchronize()
    return [KVBlockData(_host_bytes(k), _host_bytes(v)) for k, v in copies]


def _host_bytes(tensor: torch.Tensor) -> memoryview:
    # NOTE: numpy has no bfloat16: the raw bytes through a uint8 view (it keeps the buffer).
    return tensor.view(torch.uint8).numpy().data.cast("B")
