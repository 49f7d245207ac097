"""Reference-counted pool of KV blocks with a prefix cache of full blocks."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping

# NOTE: the block keys live in `pdserve.common.prefix_keys` (no numpy, so the gateway shares
# them); they are re-exported here for the engine and the services.
from pdserve.common.prefix_keys import (
    BlockHash,
    hash_block_tokens,
    layout_root,
    prefix_block_keys,
)

__all__ = ["BlockHash", "BlockPool", "hash_block_tokens", "layout_root", "prefix_block_keys"]


class BlockPool:
    """Owns the ids ``0 .. num_blocks - 1`` of the paged KV cache.

    A block is *used* while its reference count is positive and *free* otherwise. A free block
    may still be in the prefix cache (it remembers a hash); it is reused only when it reaches the
    front of the free queue (least recently freed first), and a prefix hit can revive it with
    ``touch`` before that. ``num_free_blocks`` counts every free block, cached or not.

    With ``max_cached_free_blocks`` the pool also bounds the memory it has written: at most that
    many free blocks keep their prefix (past it the least recently freed forgets its own), and
    a block freed without a prefix is reused first, before any block never used. The blocks
    ever written then stay within the most in use at once plus that bound, however large the
    pool (its pages are touched only when written): a prefill's cache can hold many prompts at
    a peak without keeping their memory after. With ``track_written`` it remembers which free
    blocks without a prefix were written since `take_written_free` last asked, whose memory the
    owner hands back when idle (a prefill's).
    """

    def __init__(
        self,
        num_blocks: int,
        enable_prefix_caching: bool = False,
        max_cached_free_blocks: int | None = None,
        track_written: bool = False,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if max_cached_free_blocks is not None and max_cached_free_blocks < 0:
            raise ValueError(
                f"max_cached_free_blocks must be >= 0 or None, got {max_cached_free_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.max_cached_free_blocks = max_cached_free_blocks
        self.ref_counts = [0] * num_blocks
        # NOTE: an ordered dict gives O(1) removal of a cached block from the middle.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # NOTE: the free blocks that carry a prefix, least recently freed first.
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self._hash_of_block: dict[int, BlockHash] = {}
        self._block_of_hash: dict[BlockHash, int] = {}
        # NOTE: with `track_written`, the blocks allocated since `take_written_free` last took
        # them (their pages hold memory until handed back).
        self._track_written = track_written
        self._written: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference (including cached blocks that may be evicted)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with at least one reference."""
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that currently carry a prefix hash."""
        return len(self._block_of_hash)

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether ``allocate(num_blocks)`` would succeed."""
        return 0 <= num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Takes ``num_blocks`` free blocks (least recently freed first), each with one reference.

        Raises:
            ValueError: If fewer blocks are free; check ``can_allocate`` first.
        """
        if not self.can_allocate(num_blocks):
            raise ValueError(f"cannot allocate {num_blocks} blocks: {len(self._free)} free")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self.ref_counts[block_id] = 1
            block_ids.append(block_id)
        if self._track_written:
            self._written.update(block_ids)
        return block_ids

    def take_written_free(self) -> list[int]:
        """The free blocks that keep no prefix and were allocated since this last took them,
        in id order; from now on they count as unwritten, for the caller to hand their memory
        back (`KVCache.release_pages`) before any is allocated again. Their place in the free
        queue does not change. Empty unless the pool was made with `track_written`."""
        block_ids = sorted(
            b for b in self._written if self.ref_counts[b] == 0 and b not in self._hash_of_block
        )
        self._written.difference_update(block_ids)
        return block_ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Drops one reference from each block; a block with none left joins the free queue.

        Pass a sequence's blocks in reverse order so that its tail is evicted before its prefix.

        Raises:
            ValueError: If a block is not in use (a double free).
        """
        for block_id in block_ids:
            if self.ref_counts[block_id] <= 0:
                raise ValueError(f"block {block_id} freed while not in use")
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self._free[block_id] = None
                if block_id in self._hash_of_block:
                    self._cached_free[block_id] = None
                elif self.max_cached_free_blocks is not None:
                    self._free.move_to_end(block_id, last=False)  # NOTE: written: reused first
        bound = self.max_cached_free_blocks
        while bound is not None and len(self._cached_free) > bound:
            oldest, _ = self._cached_free.popitem(last=False)
            self._evict(oldest)
            self._free.move_to_end(oldest, last=False)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Adds one reference to each block, taking a free (cached) block out of the free queue."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self._free[block_id]
                self._cached_free.pop(block_id, None)
            self.ref_counts[block_id] += 1

    def cache_block(self, block_id: int, block_hash: BlockHash) -> None:
        """Records that a used, full block holds the prefix identified by ``block_hash``."""
        if not self.enable_prefix_caching or block_id in self._hash_of_block:
            return
        if self.ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} cached while not in use")
        # NOTE: keep the first block for a hash; a duplicate stays uncached and is reused normally.
        if block_hash not in self._block_of_hash:
            self._block_of_hash[block_hash] = block_id
            self._hash_of_block[block_id] = block_hash

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        """The block holding ``block_hash``, or ``None``."""
        return self._block_of_hash.get(block_hash)

    def block_hash(self, block_id: int) -> BlockHash | None:
        """The prefix hash ``block_id`` is cached under, or ``None``."""
        return self._hash_of_block.get(block_id)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached hash (the blocks themselves keep their references)."""
        if self.max_cached_free_blocks is not None:
            for block_id in reversed(self._cached_free):
                self._free.move_to_end(block_id, last=False)
        self._cached_free.clear()
        self._block_of_hash.clear()
        self._hash_of_block.clear()

    def _evict(self, block_id: int) -> None:
        block_hash = self._hash_of_block.pop(block_id, None)
        if block_hash is not None:
            del self._block_of_hash[block_hash]
            self._cached_free.pop(block_id, None)

    def check_integrity(self, holders: Mapping[int, int] | None = None) -> None:
        """Verifies the pool's invariants.

        Args:
            holders: When the owner knows who holds what: how many holders (block tables)
                reference each block. Every used block must then be held, by exactly as
                many holders as its reference count: a block shared by several requests
                counts once per holder, and a reference nobody holds (a leak) or a holder
                the count misses (a block that could be freed under it) is caught.

        Raises:
            AssertionError: If free + used != total, a reference count is negative, a free block
                has references or a used block is in the free queue, an id is out of range,
                the two hash maps disagree (or hold blocks while caching is off), or a
                reference count differs from `holders`.
        """
        free_ids = list(self._free)
        if len(set(free_ids)) != len(free_ids):
            raise AssertionError("free queue holds a block twice")
        if any(not 0 <= b < self.num_blocks for b in free_ids):
            raise AssertionError("free queue holds an id out of range")
        if len(self.ref_counts) != self.num_blocks:
            raise AssertionError("ref_counts has the wrong length")
        used = [b for b, count in enumerate(self.ref_counts) if count > 0]
        if any(count < 0 for count in self.ref_counts):
            raise AssertionError("negative reference count")
        if len(free_ids) + len(used) != self.num_blocks:
            raise AssertionError(
                f"free ({len(free_ids)}) + used ({len(used)}) != total ({self.num_blocks})"
            )
        if any(self.ref_counts[b] != 0 for b in free_ids):
            raise AssertionError("a block in the free queue has references")
        if len(self._block_of_hash) != len(self._hash_of_block):
            raise AssertionError("prefix cache maps disagree in size")
        if self._hash_of_block and not self.enable_prefix_caching:
            raise AssertionError("blocks are cached while prefix caching is off")
        if any(not 0 <= b < self.num_blocks for b in self._hash_of_block):
            raise AssertionError("prefix cache holds a block id out of range")
        for block_id, block_hash in self._hash_of_block.items():
            if self._block_of_hash.get(block_hash) != block_id:
                raise AssertionError(f"prefix cache maps disagree on block {block_id}")
        cached_free = {b for b in free_ids if b in self._hash_of_block}
        if cached_free != set(self._cached_free):
            raise AssertionError("the cached free blocks are not the free blocks with a prefix")
        bound = self.max_cached_free_blocks
        if bound is not None and len(cached_free) > bound:
            raise AssertionError(f"{len(cached_free)} free blocks keep a prefix, over {bound}")
        if holders is not None:
            self._check_holders(holders)

    def _check_holders(self, holders: Mapping[int, int]) -> None:
        if any(not 0 <= b < self.num_blocks for b in holders):
            raise AssertionError("a holder references a block id out of range")
        for block_id, count in enumerate(self.ref_counts):
            held = holders.get(block_id, 0)
            if count != held:
                what = "leaked" if held < count else "held without a reference"
                raise AssertionError(
                    f"block {block_id} has {count} references but {held} holders ({what})"
                )
