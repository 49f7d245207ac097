"""The prefill scheduler's prefix cache: shared leading blocks, registration, eviction, and the
integrity check over cached blocks (block size 4, integrity checked after every pass)."""

from __future__ import annotations

import pytest

from pdserve.common.generation import SamplingParams
from pdserve.engine.block_pool import BlockPool, prefix_block_keys
from pdserve.prefill.request import Request
from pdserve.prefill.scheduler import PrefillScheduler

BLOCK_SIZE = 4
FINGERPRINT = "kv-layout-under-test"
PREFIX = [11, 12, 13, 14, 21, 22, 23, 24, 31, 32, 33, 34]  # 3 full blocks


def _request(request_id: str, token_ids: list[int]) -> Request:
    return Request(
        request_id=request_id,
        token_ids=list(token_ids),
        num_prompt_tokens=len(token_ids),
        sampling=SamplingParams(temperature=0.0),
        seed=0,
        decode_address="127.0.0.1:1",
    )


def _scheduler(num_blocks: int, *, is_caching: bool = True, budget: int = 64) -> PrefillScheduler:
    pool = BlockPool(num_blocks, enable_prefix_caching=is_caching)
    return PrefillScheduler(pool, BLOCK_SIZE, budget, FINGERPRINT)


def _prefill(scheduler: PrefillScheduler, request: Request) -> list[tuple[int, int]]:
    """Adds `request` and runs passes until it is prefilled: its (start, num_new) chunks."""
    scheduler.add_request(request)
    chunks = []
    while request.request_id not in scheduler.prefilled:
        output = scheduler.schedule()
        assert not output.is_empty, "the request was not admitted"
        scheduler.update_from_output(output)
        scheduler.check_integrity()
        chunks += [(c.num_computed_tokens, c.num_new_tokens) for c in output.scheduled]
    return chunks


def _cached_blocks(scheduler: PrefillScheduler, token_ids: list[int]) -> list[int | None]:
    """The cached block of each full block of `token_ids` (None where not cached)."""
    keys = prefix_block_keys(FINGERPRINT, token_ids, BLOCK_SIZE)
    return [scheduler.pool.get_cached_block(key) for key in keys]


def test_a_shared_three_block_prefix_is_not_computed_again() -> None:
    scheduler = _scheduler(32)
    first = _request("first", [*PREFIX, 1, 2, 3])
    assert _prefill(scheduler, first) == [(0, 15)]
    assert scheduler.pool.num_cached_blocks == 3  # the partial last block is not cached
    assert scheduler.release(first)
    second = _request("second", [*PREFIX, 7, 8, 9, 10, 5])
    assert _prefill(scheduler, second) == [(12, 5)]
    assert second.block_ids[:3] == _cached_blocks(scheduler, PREFIX)
    assert (second.num_cached_tokens, second.num_computed_tokens) == (12, 17)
    assert (scheduler.num_cache_hit_blocks, scheduler.num_cached_prompt_tokens) == (3, 12)
    # The second prompt's own full block is cached under its cluster-wide key.
    keys = prefix_block_keys(FINGERPRINT, second.token_ids, BLOCK_SIZE)
    assert second.block_keys == keys
    assert scheduler.pool.get_cached_block(keys[3]) == second.block_ids[3]
    assert scheduler.release(second)
    assert scheduler.pool.num_free_blocks == scheduler.pool.num_blocks


def test_running_requests_share_cached_blocks_with_one_reference_each() -> None:
    scheduler = _scheduler(32)
    first = _request("first", [*PREFIX, 1])
    _prefill(scheduler, first)
    second = _request("second", [*PREFIX, 2, 3])
    assert _prefill(scheduler, second) == [(12, 2)]
    shared = second.block_ids[:3]
    assert shared == first.block_ids[:3]
    assert [scheduler.pool.ref_counts[b] for b in shared] == [2, 2, 2]
    scheduler.release(first)
    assert [scheduler.pool.ref_counts[b] for b in shared] == [1, 1, 1]
    scheduler.check_integrity()


def test_a_prompt_of_whole_blocks_still_computes_its_last_token() -> None:
    scheduler = _scheduler(32)
    first = _request("first", PREFIX)
    assert _prefill(scheduler, first) == [(0, 12)]
    assert scheduler.pool.num_cached_blocks == 3
    scheduler.release(first)
    again = _request("again", PREFIX)
    # Only 2 of its 3 cached blocks are taken: the last token's logits give the first token.
    assert _prefill(scheduler, again) == [(8, 4)]
    assert again.num_cached_tokens == 8
    scheduler.release(again)


def test_without_the_cache_everything_is_computed() -> None:
    scheduler = _scheduler(32, is_caching=False)
    first = _request("first", [*PREFIX, 1])
    _prefill(scheduler, first)
    scheduler.release(first)
    second = _request("second", [*PREFIX, 2])
    assert _prefill(scheduler, second) == [(0, 13)]
    assert scheduler.pool.num_cached_blocks == 0 and scheduler.num_cache_hit_blocks == 0
    assert not second.block_keys


def test_cached_blocks_are_evicted_when_new_prompts_need_the_blocks() -> None:
    scheduler = _scheduler(8)
    for i in range(10):
        # 7 blocks each (6 full), all different: each must evict the previous one's cache.
        request = _request(f"r{i}", [100 * i + t for t in range(26)])
        assert _prefill(scheduler, request) == [(0, 26)]
        assert scheduler.pool.num_cached_blocks <= 8
        scheduler.release(request)
        scheduler.check_integrity()
    assert scheduler.pool.num_free_blocks == scheduler.pool.num_blocks
    assert scheduler.num_cache_hit_blocks == 0
    # The oldest prompt's blocks are gone, the newest one's still hit (tail evicted first).
    assert _cached_blocks(scheduler, [t for t in range(26)])[0] is None
    newest = _request("newest", [900 + t for t in range(25)])
    assert _prefill(scheduler, newest) == [(24, 1)]


def test_a_hit_on_an_evictable_block_counts_against_the_free_blocks() -> None:
    scheduler = _scheduler(6)
    first = _request("first", [*PREFIX, 1])  # 4 blocks, 3 of them cached once freed
    _prefill(scheduler, first)
    scheduler.release(first)
    holder = _request("holder", [200 + t for t in range(8)])  # takes the 2 uncached blocks
    _prefill(scheduler, holder)
    assert scheduler.pool.num_free_blocks == 4  # the 3 cached blocks and one more
    # 3 hits + 2 new blocks: reviving the hits leaves 1 free block, so it must wait.
    second = _request("second", [*PREFIX, 1, 2, 3, 4, 5])
    scheduler.add_request(second)
    assert scheduler.schedule().is_empty
    scheduler.check_integrity()
    scheduler.release(holder)
    output = scheduler.schedule()
    assert [(c.num_computed_tokens, c.num_new_tokens) for c in output.scheduled] == [(12, 5)]
    scheduler.update_from_output(output)
    scheduler.check_integrity()
    scheduler.release(second)
    assert scheduler.pool.num_free_blocks == scheduler.pool.num_blocks


@pytest.mark.parametrize("corruption", ["wrong_key", "shared_uncached"])
def test_integrity_check_covers_the_cached_blocks(corruption: str) -> None:
    scheduler = _scheduler(32)
    first = _request("first", [*PREFIX, 1])
    _prefill(scheduler, first)
    second = _request("second", [*PREFIX[:8], 5, 6, 7, 8, 9])
    _prefill(scheduler, second)
    if corruption == "wrong_key":
        # Block 2 of `second` holds other tokens than block 2 of `first` it claims to hold.
        scheduler.pool.reset_prefix_cache()
        for index in (0, 1):
            scheduler.pool.cache_block(first.block_ids[index], first.block_keys[index])
        scheduler.check_integrity()
        scheduler.pool.cache_block(second.block_ids[2], first.block_keys[2])
        match = "cached under another key"
    else:
        partial = second.block_ids[3]  # never cached: a later chunk of `second` may write it
        scheduler.pool.touch([partial])
        first.block_ids.append(partial)
        match = "uncached block is shared"
    with pytest.raises(AssertionError, match=match):
        scheduler.check_integrity()
