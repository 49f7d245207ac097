"""A CPU KV cache takes memory only as its blocks are written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.kv_cache import KVCache, KVCacheLayout

MIB = 1 << 20
GIB = 1 << 30

# 4 layers, 2 KV heads of 32, float32: 32 KiB per block of 16 (K and V, every layer).
LAYOUT = KVCacheLayout(num_layers=4, num_kv_heads=2, head_dim=32, block_size=16, dtype="float32")


def _resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads /proc")
def test_a_cpu_cache_takes_memory_only_as_its_blocks_are_written() -> None:
    before = _resident_bytes()
    cache = KVCache(LAYOUT, GIB // (32 * 1024), torch.device("cpu"))
    assert cache.nbytes == GIB
    assert _resident_bytes() - before < 64 * MIB
    k, v = cache.layer(3)
    k[7].fill_(2.0)
    assert k[7].sum().item() == 2.0 * k[7].numel()
    assert k[6].abs().sum().item() == v[7].abs().sum().item() == 0.0
    assert _resident_bytes() - before < 64 * MIB


def test_a_cpu_cache_can_move_into_a_host_buffer() -> None:
    cache = KVCache(LAYOUT, 8, torch.device("cpu"))
    k, _ = cache.layer(0)
    k[2].fill_(1.5)
    buffer = bytearray(cache.nbytes)
    cache.place_in(memoryview(buffer))
    assert cache.layer(0)[0][2].sum().item() == 1.5 * k[2].numel()
    assert any(buffer)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")
@pytest.mark.parametrize("is_empty", [True, False])
def test_an_empty_cache_moves_into_its_segment_without_touching_its_pages(is_empty: bool) -> None:
    from pdserve.kv.transports.shm import KvSegment

    cache = KVCache(LAYOUT, 256 * MIB // (32 * 1024), torch.device("cpu"))
    if not is_empty:
        cache.layer(1)[1][5].fill_(3.0)  # a written block: it moves with the cache
    before = _resident_bytes()
    segment = KvSegment.create(cache, is_empty=is_empty)
    try:
        grown = _resident_bytes() - before
        # NOTE: the copy writes every page of the mapping (256 MiB); the empty cache none.
        assert grown < 32 * MIB if is_empty else grown > 200 * MIB
        k, v = cache.layer(1)
        assert k.abs().sum().item() == 0.0
        assert v[5].sum().item() == (0.0 if is_empty else 3.0 * v[5].numel())
        k[3].fill_(2.0)  # lands in the segment: another mapping of its file reads it
        with segment.path.open("rb") as file:
            file.seek(cache.kv[1, 0, 3].data_ptr() - cache.kv.data_ptr())
            assert file.read(4) == torch.tensor([2.0]).numpy().tobytes()
    finally:
        segment.remove()
