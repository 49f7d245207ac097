"""The colocated `LLMEngine`'s request-level block bookkeeping on the block pool (vLLM's KV
cache manager).

The services keep their own (the prefill's scheduler, the decode's lease table).
"""

from __future__ import annotations

from pdserve.common.generation import num_blocks_for
from pdserve.engine.block_pool import BlockPool, hash_block_tokens
from pdserve.engine.colocated.request import Request
from pdserve.engine.window_slots import WindowSlots, first_in_window


class KVCacheManager:
    """Allocates, caches and frees the blocks of requests.

    With `window_slots` (a cache whose sliding layers keep only their window), a request
    holds the window slot of each of its blocks from allocation until its next token is a
    whole window past the block (`release_window`), and a prefix hit counts only where the
    blocks in the window of its end still have their slots.

    Args:
        block_pool: The pool that owns the block ids.
        block_size: Tokens per block.
        window_slots: The cache's window slots, or None.
        window: The widest sliding window (with `window_slots`).
    """

    def __init__(
        self,
        block_pool: BlockPool,
        block_size: int,
        window_slots: WindowSlots | None = None,
        window: int = 0,
    ) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        self.window_slots = window_slots
        self.window = window

    def first_in_window(self, position: int) -> int:
        """The first block a query at `position` (and every later one) may read in a sliding
        layer."""
        return first_in_window(position, self.window, self.block_size)

    @property
    def enable_prefix_caching(self) -> bool:
        """Whether full blocks are hashed and reused across requests."""
        return self.block_pool.enable_prefix_caching

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Finds the longest cached prefix of a request that holds no blocks yet.

        At least the last token is always left to compute, since its logits are needed.

        Returns:
            ``(block_ids, num_computed_tokens)`` of the hit; the blocks are not yet referenced.
        """
        if not self.enable_prefix_caching or request.block_ids:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        block_ids: list[int] = []
        parent = None
        for index in range(max_blocks):
            start = index * self.block_size
            parent = hash_block_tokens(parent, request.token_ids[start : start + self.block_size])
            block_id = self.block_pool.get_cached_block(parent)
            if block_id is None:
                break
            block_ids.append(block_id)
        if self.window_slots is not None:
            # NOTE: the first new token reads the window before it: those blocks need the
            # sliding layers' KV too, so the hit ends where they still have it.
            slots = self.window_slots
            while block_ids and not all(
                slots.is_mapped(b)
                for b in block_ids[self.first_in_window(len(block_ids) * self.block_size) :]
            ):
                block_ids.pop()
        return block_ids, len(block_ids) * self.block_size

    def num_blocks_needed(
        self, request: Request, num_new_tokens: int, num_hit_blocks: int = 0
    ) -> int:
        """Blocks to take from the free queue so that ``num_new_tokens`` more tokens fit."""
        num_tokens = request.num_computed_tokens + num_new_tokens
        if num_hit_blocks:
            num_tokens = num_hit_blocks * self.block_size + num_new_tokens
        num_blocks = num_blocks_for(num_tokens, self.block_size)
        return max(0, num_blocks - len(request.block_ids) - num_hit_blocks)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, hit_block_ids: list[int] | None = None
    ) -> bool:
        """Makes room for ``num_new_tokens`` more tokens of KV in the request's block table.

        Args:
            request: The request; its ``block_ids`` grow in place.
            num_new_tokens: Tokens to be computed in the coming step.
            hit_block_ids: Prefix-cache hits from ``get_computed_blocks`` to adopt first.

        Returns:
            False (and no change) if the pool has too few free blocks.
        """
        hit_block_ids = hit_block_ids or []
        # NOTE: reviving a cached free block takes it out of the free queue, so count it.
        num_revived = sum(1 for b in hit_block_ids if self.block_pool.ref_counts[b] == 0)
        num_needed = self.num_blocks_needed(request, num_new_tokens, len(hit_block_ids))
        if not self.block_pool.can_allocate(num_needed + num_revived):
            return False
        slots = self.window_slots
        hit_in_window: list[int] = []
        if slots is not None:
            first = self.first_in_window(len(hit_block_ids) * self.block_size)
            hit_in_window = hit_block_ids[first:]
            if slots.num_to_take(hit_in_window) + num_needed > slots.num_free:
                return False
        if hit_block_ids:
            self.block_pool.touch(hit_block_ids)
            request.block_ids.extend(hit_block_ids)
            request.num_computed_tokens = len(hit_block_ids) * self.block_size
        new_block_ids = self.block_pool.allocate(num_needed)
        request.block_ids.extend(new_block_ids)
        if slots is not None:
            if hit_block_ids:
                request.num_window_released = len(hit_block_ids) - len(hit_in_window)
                slots.hold(hit_in_window)
            # NOTE: a reused id still mapped to a free slot takes that slot back; its stale
            # positions are rewritten before any window reads them.
            slots.hold(new_block_ids)
        return True

    def release_window(self, request: Request) -> None:
        """Lets go of the window slots of the request's blocks that its next token (and every
        later one) is a whole window past."""
        if self.window_slots is None:
            return
        first = min(self.first_in_window(request.num_computed_tokens), len(request.block_ids))
        if first > request.num_window_released:
            self.window_slots.let_go(request.block_ids[request.num_window_released : first])
            request.num_window_released = first

    def cache_blocks(self, request: Request) -> None:
        """Hashes the request's blocks that became full of computed KV and caches them."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        for index in range(len(request.block_hashes), num_full):
            start = index * self.block_size
            parent = request.block_hashes[-1] if request.block_hashes else None
            block_hash = hash_block_tokens(
                parent, request.token_ids[start : start + self.block_size]
            )
            request.block_hashes.append(block_hash)
            self.block_pool.cache_block(request.block_ids[index], block_hash)

    def free(self, request: Request) -> None:
        """Releases the request's blocks, tail first, and forgets its block table."""
        if self.window_slots is not None:
            self.window_slots.let_go(request.block_ids[request.num_window_released :])
            request.num_window_released = 0
        self.block_pool.free(reversed(request.block_ids))
        request.block_ids = []
        request.block_hashes = []
