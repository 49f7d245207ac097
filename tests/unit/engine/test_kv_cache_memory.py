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


def _mapping_resident_bytes(address: int) -> int:
    """Rss of the mapping of this process that holds `address` (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for index, line in enumerate(lines):
        span = line.split(" ", 1)[0]
        if "-" not in span or ":" in span:
            continue
        start, end = (int(part, 16) for part in span.split("-"))
        if start <= address < end:
            for detail in lines[index + 1 :]:
                if detail.startswith("Rss:"):
                    return int(detail.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="reads /proc")
def test_released_blocks_hand_their_pages_back_and_the_others_keep_their_bytes() -> None:
    # 8 KiB per block of one layer's K (or V): two pages.
    layout = KVCacheLayout(
        num_layers=3, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32"
    )
    cache = KVCache(layout, 64, torch.device("cpu"))
    cache.kv.fill_(1.0)
    written = _mapping_resident_bytes(cache.kv.data_ptr())
    assert written >= cache.nbytes
    released = [*range(8, 40), 50]
    assert cache.release_pages(released) == len(released) * 3 * 2 * layout.block_nbytes
    assert written - _mapping_resident_bytes(cache.kv.data_ptr()) >= 33 * 6 * layout.block_nbytes
    for layer in range(3):
        for kv in cache.layer(layer):
            assert kv[released].abs().sum().item() == 0.0  # read as zeros
            kept = [b for b in range(64) if b not in released]
            assert kv[kept].eq(1.0).all()
    cache.layer(1)[0][50].fill_(4.0)  # written again: the block takes memory and holds it
    assert cache.layer(1)[0][50].eq(4.0).all()


def test_pages_a_released_run_shares_with_a_kept_block_stay() -> None:
    # 1 KiB per block of one layer's K: four blocks to a page.
    layout = KVCacheLayout(
        num_layers=1, num_kv_heads=1, head_dim=16, block_size=16, dtype="float32"
    )
    cache = KVCache(layout, 32, torch.device("cpu"))
    cache.kv.fill_(1.0)
    assert cache.release_pages([1, 2, 3, 4, 5, 6]) == 0  # no whole page: blocks 0 and 7 share
    assert cache.kv.eq(1.0).all()
    assert cache.release_pages(range(4, 12)) == 2 * 2 * 4096  # blocks 4-11 fill two pages, K and V
    assert cache.kv[:, :, 4:12].abs().sum().item() == 0.0 and cache.kv[:, :, :4].eq(1.0).all()


def test_a_cache_in_private_memory_hands_back_nothing() -> None:
    kv = torch.ones(LAYOUT.cache_shape(64))
    cache = KVCache(LAYOUT, 64, torch.device("cpu"), kv=kv)
    assert cache.release_pages(range(64)) == 0
    assert cache.kv.eq(1.0).all()


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")
def test_a_tensor_parallel_cache_file_hands_back_the_pages_of_released_blocks() -> None:
    from pdserve.engine.parallel.shared_cache import create_shared_cache, remove_shared_cache

    layout = KVCacheLayout(
        num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32"
    )
    cache = create_shared_cache(layout, 64)  # in /dev/shm, as a tensor-parallel instance's
    try:
        assert cache.shared_path is not None
        cache.kv.fill_(1.0)
        allocated = cache.shared_path.stat().st_blocks * 512
        released = cache.release_pages(range(16, 48))
        assert released == 32 * 2 * 2 * layout.block_nbytes
        # NOTE: the file's pages themselves are gone, for every rank that maps it.
        assert allocated - cache.shared_path.stat().st_blocks * 512 == released
        assert cache.kv[:, :, 16:48].abs().sum().item() == 0.0
        assert cache.kv[:, :, :16].eq(1.0).all() and cache.kv[:, :, 48:].eq(1.0).all()
    finally:
        remove_shared_cache(cache)
