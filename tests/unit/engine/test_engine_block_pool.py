"""Block pool: reference counts, prefix hashes, and an integrity check that catches damage."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pdserve.engine import BlockPool, hash_block_tokens
from pdserve.engine.block_pool import layout_root, prefix_block_keys


def test_allocate_free_and_counts() -> None:
    pool = BlockPool(8)
    assert pool.can_allocate(8) and not pool.can_allocate(9)
    first = pool.allocate(3)
    second = pool.allocate(5)
    assert sorted(first + second) == list(range(8))
    assert pool.num_free_blocks == 0 and pool.num_used_blocks == 8
    with pytest.raises(ValueError, match="cannot allocate"):
        pool.allocate(1)
    pool.free(first)
    assert pool.num_free_blocks == 3
    pool.check_integrity()
    with pytest.raises(ValueError, match="not in use"):
        pool.free([first[0]])
    pool.check_integrity()


def test_shared_blocks_are_freed_by_the_last_reference() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.touch(blocks)
    pool.free(blocks)
    assert pool.num_free_blocks == 2
    pool.free(blocks)
    assert pool.num_free_blocks == 4
    pool.check_integrity()


def test_least_recently_freed_blocks_are_reused_first() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    pool.free([blocks[2], blocks[0]])
    assert pool.allocate(1) == [blocks[2]]


def test_hash_is_chained_over_parent_and_tokens() -> None:
    root = hash_block_tokens(None, [1, 2, 3, 4])
    assert root == hash_block_tokens(None, [1, 2, 3, 4])
    assert root != hash_block_tokens(None, [1, 2, 3, 5])
    child = hash_block_tokens(root, [9, 9, 9, 9])
    other_parent = hash_block_tokens(hash_block_tokens(None, [0, 2, 3, 4]), [9, 9, 9, 9])
    assert child != other_parent


def test_cached_free_block_is_revived_or_evicted() -> None:
    pool = BlockPool(3, enable_prefix_caching=True)
    block_hash = hash_block_tokens(None, [7, 7])
    (block,) = pool.allocate(1)
    pool.cache_block(block, block_hash)
    pool.free([block])
    assert pool.get_cached_block(block_hash) == block and pool.num_free_blocks == 3
    pool.touch([block])  # a prefix hit takes it back out of the free queue
    assert pool.num_free_blocks == 2 and pool.ref_counts[block] == 1
    pool.free([block])
    pool.allocate(3)  # reusing every block evicts the cached hash
    assert pool.get_cached_block(block_hash) is None
    pool.check_integrity()


@pytest.mark.parametrize(
    "damage",
    [
        lambda pool: pool.ref_counts.__setitem__(0, 1),  # referenced block left in free queue
        lambda pool: pool.ref_counts.__setitem__(5, 0),  # used block lost: not free, no refs
        lambda pool: pool.ref_counts.__setitem__(5, -1),
        lambda pool: pool._free.__setitem__(99, None),  # id out of range
        lambda pool: pool._block_of_hash.__setitem__(b"x", 5),  # hash maps disagree
    ],
)
def test_integrity_check_catches_damage(damage: object) -> None:
    pool = BlockPool(8, enable_prefix_caching=True)
    pool.allocate(6)
    pool.free([0])
    pool.check_integrity()
    assert callable(damage)
    damage(pool)
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_prefix_block_keys_chain_over_tokens_and_are_scoped_by_layout() -> None:
    tokens = list(range(40))
    keys = prefix_block_keys("layout-a", tokens, 16)
    assert len(keys) == 2  # the partial last block has no key
    assert keys == prefix_block_keys("layout-a", tokens[:32], 16)
    assert keys[0] == hash_block_tokens(layout_root("layout-a"), tokens[:16])
    assert keys[1] == hash_block_tokens(keys[0], tokens[16:32])
    assert prefix_block_keys("layout-b", tokens, 16)[0] != keys[0]
    changed = prefix_block_keys("layout-a", [99, *tokens[1:]], 16)
    assert changed[0] != keys[0] and changed[1] != keys[1]  # a key covers every earlier token


def test_holders_check_counts_a_shared_block_once_per_holder() -> None:
    pool = BlockPool(6)
    first = pool.allocate(3)
    second = [*first[:2], *pool.allocate(1)]  # shares the first two blocks
    pool.touch(first[:2])
    holders = Counter([*first, *second])
    pool.check_integrity(holders)
    pool.free(first)  # the first holder ends: the shared blocks stay in use
    assert pool.num_used_blocks == 3
    pool.check_integrity(Counter(second))
    pool.free(second)
    assert pool.num_free_blocks == 6
    pool.check_integrity(Counter())


def test_holders_check_catches_a_leaked_reference() -> None:
    pool = BlockPool(4)
    held = pool.allocate(2)
    pool.touch(held[:1])  # a reference nobody holds
    pool.check_integrity()  # the pool alone cannot tell
    with pytest.raises(AssertionError, match=f"block {held[0]} has 2 references but 1 holders"):
        pool.check_integrity(Counter(held))


def test_holders_check_catches_a_holder_without_a_reference() -> None:
    pool = BlockPool(4)
    first = pool.allocate(2)
    second = [first[0]]  # holds a block it never took a reference to
    with pytest.raises(AssertionError, match="held without a reference"):
        pool.check_integrity(Counter([*first, *second]))
    free_block = next(b for b in range(4) if b not in first)
    with pytest.raises(AssertionError, match="held without a reference"):
        pool.check_integrity(Counter([*first, free_block]))


def written_blocks_under_load(max_cached_free_blocks: int | None) -> tuple[int, int]:
    """Runs one seeded stream of prompts of 1-12 blocks, up to five held at once, each full
    block cached under a key of its own (the last is partial: not cached) and freed in reverse;
    returns (blocks ever allocated, the most in use at once)."""
    rng = random.Random(7)
    pool = BlockPool(
        1000, enable_prefix_caching=True, max_cached_free_blocks=max_cached_free_blocks
    )
    held: list[list[int]] = []
    written: set[int] = set()
    peak = 0
    for prompt in range(300):
        if len(held) == 5 or (held and rng.random() < 0.4):
            pool.free(reversed(held.pop(rng.randrange(len(held)))))
        blocks = pool.allocate(rng.randint(1, 12))
        for index, block_id in enumerate(blocks[:-1]):
            pool.cache_block(block_id, hash_block_tokens(None, (prompt, index)))
        held.append(blocks)
        written.update(blocks)
        peak = max(peak, pool.num_used_blocks)
        pool.check_integrity()
    return len(written), peak


def test_a_bounded_cache_writes_no_more_blocks_than_the_peak_in_use_and_the_bound() -> None:
    written, peak = written_blocks_under_load(max_cached_free_blocks=20)
    assert written <= peak + 20
    unbounded_written, unbounded_peak = written_blocks_under_load(max_cached_free_blocks=None)
    assert unbounded_peak == peak  # NOTE: the same load: only which blocks it writes differs
    assert unbounded_written > 3 * (peak + 20)


def test_a_bounded_cache_keeps_the_most_recently_freed_prefixes_and_forgets_the_oldest() -> None:
    pool = BlockPool(16, enable_prefix_caching=True, max_cached_free_blocks=3)
    keys = [hash_block_tokens(None, (i,)) for i in range(5)]
    blocks = pool.allocate(5)
    for block_id, key in zip(blocks, keys, strict=True):
        pool.cache_block(block_id, key)
    pool.free(reversed(blocks))  # NOTE: the tail first: it is forgotten first
    assert [pool.get_cached_block(key) for key in keys] == [*blocks[:3], None, None]
    assert pool.num_cached_blocks == 3 and pool.num_free_blocks == 16
    # NOTE: the two that forgot theirs are reused next, before blocks never written.
    assert sorted(pool.allocate(2)) == sorted(blocks[3:])
    # NOTE: a hit revives a cached block; freed again, it is the most recent.
    pool.touch([blocks[0]])
    assert pool.get_cached_block(keys[0]) == blocks[0]
    pool.free([blocks[0]])
    pool.check_integrity()
    pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0
    assert sorted(pool.allocate(3)) == sorted(blocks[:3])
    pool.check_integrity()


def test_the_bound_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="max_cached_free_blocks"):
        BlockPool(4, enable_prefix_caching=True, max_cached_free_blocks=-1)


def test_the_written_free_blocks_without_a_prefix_are_taken_once() -> None:
    untracked = BlockPool(4)
    untracked.free(untracked.allocate(4))
    assert untracked.take_written_free() == []  # a pool made without track_written
    pool = BlockPool(8, enable_prefix_caching=True, max_cached_free_blocks=4, track_written=True)
    assert pool.take_written_free() == []  # nothing was ever written
    kept, cached, freed = pool.allocate(2), pool.allocate(1), pool.allocate(3)
    pool.cache_block(cached[0], b"prefix")
    pool.free([*cached, *freed])
    assert pool.take_written_free() == sorted(freed)  # not the used, not the cached
    assert pool.take_written_free() == []  # counted unwritten since
    pool.free(kept)
    again = pool.allocate(2)  # the freed blocks first, then the rest
    pool.free(again)
    assert pool.take_written_free() == sorted(set(kept) | set(again))
    assert pool.get_cached_block(b"prefix") == cached[0]
    pool.check_integrity()
