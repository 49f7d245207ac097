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
