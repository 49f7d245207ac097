"""Test data for the KV storage tier: a small KV layout, filled caches, block keys."""

from __future__ import annotations

import torch

from pdserve.common.protocol import kv_layout_fingerprint
from pdserve.engine.block_pool import prefix_block_keys
from pdserve.engine.kv_cache import KVCache, KVCacheLayout

LAYOUT = KVCacheLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
FINGERPRINT = kv_layout_fingerprint("tiny@sha256:0", 3, 2, 8, "KV_DTYPE_FLOAT32", 4)
OTHER_FINGERPRINT = kv_layout_fingerprint("tiny@sha256:1", 3, 2, 8, "KV_DTYPE_FLOAT32", 4)


def filled_cache(layout: KVCacheLayout = LAYOUT, num_blocks: int = 8, seed: int = 0) -> KVCache:
    """A CPU cache whose every element is random (so a wrong block or layer shows)."""
    cache = KVCache(layout, num_blocks, torch.device("cpu"))
    generator = torch.Generator().manual_seed(seed)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=generator).to(cache.dtype))
    return cache


def block_keys(num_blocks: int, salt: int = 0) -> list[bytes]:
    """The keys of a prompt of `num_blocks` full blocks (different `salt`, different prompt)."""
    token_ids = [salt * 1000 + i for i in range(num_blocks * LAYOUT.block_size)]
    return prefix_block_keys(FINGERPRINT, token_ids, LAYOUT.block_size)
