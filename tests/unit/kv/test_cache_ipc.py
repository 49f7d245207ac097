"""The cuda_ipc exchange with its CPU stand-in: export once, map once per decode, write a
lease's blocks in place, close the mapping when the decode is gone."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest
import torch

from pdserve.engine.kv_cache import KVCache, KVCacheLayout
from pdserve.kv.transfer import KvPiece, blocks_crc32c, layer_pieces
from pdserve.kv.transports.cuda_ipc import CacheUnavailable, export_cache, open_cache
from pdserve.kv.transports.cuda_ipc_window import MappedCaches

LAYOUT = KVCacheLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")


def _caches(tmp_path: Path) -> tuple[KVCache, KVCache, MappedCaches]:
    """A decode's cache (exported into a segment under `tmp_path`), a prefill's cache full of
    distinct values, and the prefill's mappings."""
    decode = KVCache(LAYOUT, num_blocks=12, device=torch.device("cpu"))
    prefill = KVCache(LAYOUT, num_blocks=6, device=torch.device("cpu"))
    prefill.kv.copy_(torch.randn(prefill.kv.shape, generator=torch.Generator().manual_seed(3)))
    return decode, prefill, MappedCaches(prefill, directory=tmp_path)


def test_a_leases_blocks_land_bit_exact_in_the_exporters_cache(tmp_path: Path) -> None:
    decode, prefill, caches = _caches(tmp_path)
    export = export_cache(decode, directory=tmp_path)
    assert export.handle.device_kind == "cpu" and caches.can_map(export.handle)
    lease_ids, source_ids = [7, 2, 3, 10], [4, 0, 1, 5]
    window = caches.open(export.handle).window(lease_ids, 0, prefill)
    for layer in range(LAYOUT.num_layers):
        for piece in layer_pieces(prefill, layer, source_ids, 3):
            crc = window.write(piece)
            window.wait()
            # What the decode verifies in its own cache is what the sender announced.
            leased = lease_ids[piece.first_block : piece.first_block + piece.num_blocks]
            assert blocks_crc32c(decode, layer, leased) == crc
    for lease_id, source_id in zip(lease_ids, source_ids, strict=True):
        assert torch.equal(
            decode.kv[:, :, lease_id].view(torch.uint8),
            prefill.kv[:, :, source_id].view(torch.uint8),
        )
    untouched = [b for b in range(decode.num_blocks) if b not in lease_ids]
    assert not decode.kv[:, :, untouched].any()


def test_a_window_writes_only_its_leases_writable_blocks(tmp_path: Path) -> None:
    decode, prefill, caches = _caches(tmp_path)
    cache = caches.open(export_cache(decode, directory=tmp_path).handle)
    data = memoryview(bytearray(LAYOUT.block_nbytes))
    window = cache.window([4, 5], 1, prefill)  # the first block is shared: read-only
    with pytest.raises(IndexError, match="outside"):
        window.write(KvPiece(0, 2, 1, data, data, (0,)))
    with pytest.raises(IndexError, match="shared"):
        window.write(KvPiece(0, 0, 1, data, data, (0,)))
    with pytest.raises(IndexError, match="sources"):
        window.write(KvPiece(0, 1, 1, data, data))  # not cut from the sender's cache
    window.write(KvPiece(0, 1, 1, data, data, (1,)))
    with pytest.raises(ValueError, match="outside"):
        cache.window([12], 0, prefill)


def test_each_decode_is_mapped_once_and_unmapped_once_it_is_gone(tmp_path: Path) -> None:
    decode, _, caches = _caches(tmp_path)
    export = export_cache(decode, directory=tmp_path)
    cache = caches.open(export.handle)
    assert caches.open(export.handle) is cache and len(caches) == 1
    assert caches.close_lost() == 0
    assert export.segment is not None
    export.segment.remove()  # the decode stopped
    assert caches.close_lost() == 1
    assert cache.kv is None and len(caches) == 0
    with pytest.raises(CacheUnavailable):
        caches.open(export.handle)


def test_a_handle_that_does_not_fit_here_is_unavailable(tmp_path: Path) -> None:
    decode, _, caches = _caches(tmp_path)
    handle = export_cache(decode, directory=tmp_path).handle
    elsewhere = dataclasses.replace(handle, host_id="another-host")
    assert not caches.can_map(elsewhere)
    assert not caches.can_map(dataclasses.replace(handle, device_kind="cuda:NVIDIA H100"))
    with pytest.raises(CacheUnavailable, match="another host"):
        open_cache(elsewhere, LAYOUT, tmp_path)
    with pytest.raises(CacheUnavailable, match="whole KV blocks"):
        open_cache(dataclasses.replace(handle, num_bytes=handle.num_bytes - 1), LAYOUT, tmp_path)
    missing = dataclasses.replace(handle, memory_handle=b"pdserve-kv-1-missing")
    with pytest.raises(CacheUnavailable):
        open_cache(missing, LAYOUT, tmp_path)
    with pytest.raises(CacheUnavailable):
        open_cache(dataclasses.replace(handle, memory_handle=b"../etc"), LAYOUT, tmp_path)


def test_a_mapping_whose_decode_process_ended_is_closed(tmp_path: Path) -> None:
    decode, _, caches = _caches(tmp_path)
    handle = export_cache(decode, directory=tmp_path).handle
    dead = subprocess.Popen(["true"])
    dead.wait()
    cache = caches.open(dataclasses.replace(handle, process_id=dead.pid))
    assert caches.close_lost() == 1
    assert cache.kv is None
