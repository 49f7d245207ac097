"""KV through host staging buffers, on CPU: chunks read into a cache's blocks (the TCP port's
path into a CUDA cache) and a layer's pieces copied out (a CUDA sender's path, pinned there)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pdserve.engine.kv_cache import KVCache, KVCacheLayout
from pdserve.kv.staging import HostStaging, export_to_host

LAYOUT = KVCacheLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")


def _reader(data: bytes, step: int) -> Callable[[memoryview], None]:
    """A `recv_into` loop over `data` that returns at most `step` bytes per call."""
    position = 0

    def fill(view: memoryview) -> None:
        nonlocal position
        received = 0
        while received < len(view):
            count = min(step, len(view) - received)
            view[received : received + count] = data[position : position + count]
            position += count
            received += count

    return fill


def test_a_staged_chunk_lands_bit_exact_in_its_blocks_only() -> None:
    source = KVCache(LAYOUT, 4, torch.device("cpu"))
    source.kv.normal_()
    cache = KVCache(LAYOUT, 8, torch.device("cpu"))
    staging = HostStaging(cache)
    exported = source.export_blocks(1, [0, 1, 2])
    chunk = bytes(exported.k) + bytes(exported.v)
    staging.fill(1, [6, 1, 3], _reader(chunk, 7)).wait()
    assert torch.equal(
        cache.kv[1, :, [6, 1, 3]].view(torch.uint8), source.kv[1, :, :3].view(torch.uint8)
    )
    assert not cache.kv[0].any() and not cache.kv[1, :, [0, 2, 4, 5, 7]].any()


def test_a_connection_that_breaks_mid_chunk_copies_nothing() -> None:
    cache = KVCache(LAYOUT, 8, torch.device("cpu"))

    def broken(view: memoryview) -> None:
        raise ConnectionError("closed")

    with pytest.raises(ConnectionError):
        HostStaging(cache).fill(0, [2], broken)
    assert not cache.kv.any()


def test_a_layer_copied_out_through_host_buffers_has_the_export_layout() -> None:
    cache = KVCache(LAYOUT, 8, torch.device("cpu"))
    cache.kv.normal_()
    runs = [(5, 2, 7), (0,), (3, 4)]
    copied = export_to_host(cache, 1, runs, pin=False)
    for run, data in zip(runs, copied, strict=True):
        exported = cache.export_blocks(1, run)
        assert bytes(data.k) == bytes(exported.k) and bytes(data.v) == bytes(exported.v)
