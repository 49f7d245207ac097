"""The prefill-only scheduler: FCFS, token budget, chunking, whole-prompt admission."""

from __future__ import annotations

import pytest

from pdserve.common.generation import SamplingParams
from pdserve.engine.block_pool import BlockPool
from pdserve.prefill.request import Request
from pdserve.prefill.scheduler import PrefillScheduler

BLOCK_SIZE = 4


def _request(request_id: str, num_tokens: int) -> Request:
    return Request(
        request_id=request_id,
        token_ids=list(range(3, 3 + num_tokens)),
        num_prompt_tokens=num_tokens,
        sampling=SamplingParams(temperature=0.0),
        seed=0,
        decode_address="127.0.0.1:1",
    )


def _run_pass(scheduler: PrefillScheduler) -> list[tuple[str, int, int]]:
    output = scheduler.schedule()
    scheduler.update_from_output(output)
    scheduler.check_integrity()
    return [
        (c.request.request_id, c.num_computed_tokens, c.num_new_tokens) for c in output.scheduled
    ]


def test_several_prompts_share_a_pass_up_to_the_budget() -> None:
    scheduler = PrefillScheduler(BlockPool(64), BLOCK_SIZE, max_num_batched_tokens=32)
    for request_id, num_tokens in (("a", 10), ("b", 12), ("c", 6), ("d", 9)):
        scheduler.add_request(_request(request_id, num_tokens))
    # a, b and c fit whole (28 tokens); d gets the remaining 4 tokens and continues next pass.
    assert _run_pass(scheduler) == [("a", 0, 10), ("b", 0, 12), ("c", 0, 6), ("d", 0, 4)]
    assert _run_pass(scheduler) == [("d", 4, 5)]
    assert not scheduler.has_unfinished_requests()
    assert sorted(scheduler.prefilled) == ["a", "b", "c", "d"]


def test_a_long_prompt_is_chunked_and_continues_before_newer_requests() -> None:
    scheduler = PrefillScheduler(BlockPool(64), BLOCK_SIZE, max_num_batched_tokens=16)
    scheduler.add_request(_request("long", 40))
    scheduler.add_request(_request("short", 5))
    assert _run_pass(scheduler) == [("long", 0, 16)]
    assert _run_pass(scheduler) == [("long", 16, 16)]
    assert _run_pass(scheduler) == [("long", 32, 8), ("short", 0, 5)]


def test_admission_is_fcfs_and_waits_for_blocks() -> None:
    pool = BlockPool(10)
    scheduler = PrefillScheduler(pool, BLOCK_SIZE, max_num_batched_tokens=64)
    first, big, small = _request("first", 24), _request("big", 20), _request("small", 4)
    for request in (first, big, small):
        scheduler.add_request(request)
    # first takes 6 of 10 blocks; big needs 5 and must wait; small (1 block) may not overtake.
    assert _run_pass(scheduler) == [("first", 0, 24)]
    assert scheduler.schedule().is_empty
    assert len(first.block_ids) == 6 and not big.block_ids and not small.block_ids
    assert scheduler.release(first)
    assert pool.num_free_blocks == 10
    assert _run_pass(scheduler) == [("big", 0, 20), ("small", 0, 4)]


@pytest.mark.parametrize("stage", ["waiting", "running", "prefilled"])
def test_release_frees_blocks_at_any_stage(stage: str) -> None:
    pool = BlockPool(16)
    scheduler = PrefillScheduler(pool, BLOCK_SIZE, max_num_batched_tokens=8)
    request = _request("r", 20)
    scheduler.add_request(request)
    if stage in ("running", "prefilled"):
        _run_pass(scheduler)
    if stage == "prefilled":
        while scheduler.has_unfinished_requests():
            _run_pass(scheduler)
        assert "r" in scheduler.prefilled
    assert scheduler.release(request)
    assert not scheduler.release(request)  # once
    scheduler.check_integrity()
    assert pool.num_free_blocks == pool.num_blocks
    assert not scheduler.has_unfinished_requests() and not scheduler.prefilled
