"""Completions of one prompt share its full KV blocks on the decode: reference-counted, freed
with the last holder, and checked by the lease table's integrity check."""

from __future__ import annotations

import pytest

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.decode.block_sharing import prefix_mismatch, share_grant
from pdserve.decode.lease_state import RequestStatus
from pdserve.decode.leases import LeaseManager
from pdserve.decode.request import DecodeRequest
from pdserve.engine.block_pool import BlockPool

BLOCK_SIZE = 4
PROMPT = list(range(100, 110))  # 10 tokens: 2 full blocks and a partial one


def _manager(num_blocks: int = 16) -> LeaseManager:
    return LeaseManager(
        BlockPool(num_blocks), BLOCK_SIZE, reserve_tokens=0, ttl_s=10.0, is_insecure=True
    )


def _commit(leases: LeaseManager, lease: DecodeRequest, prompt: list[int]) -> None:
    """What a verified SyncCache commit does to the lease (without the decode thread)."""
    leases.begin_sync(lease.lease_id, lease.lease_token, None)
    leases.table.end_sync(lease)
    assert leases.table.advance(lease, RequestStatus.COMMITTED)
    lease.token_ids = [*prompt, 7]
    lease.num_prompt_tokens = len(prompt)


def test_a_completion_shares_the_prompt_blocks_of_a_committed_sibling() -> None:
    leases = _manager()
    first = leases.allocate("r-0", len(PROMPT), 4, share_key="k")
    _commit(leases, first, PROMPT)
    second = leases.allocate("r-1", len(PROMPT), 4, share_key="k")
    assert second.num_shared_blocks == 2
    assert second.block_ids[:2] == first.block_ids[:2]
    assert not set(second.block_ids[2:]) & set(first.block_ids)  # its own partial block
    assert second.shared_token_ids == tuple(PROMPT[:8])
    assert leases.table.pool.num_used_blocks == 4
    assert leases.num_shared_blocks == 2 and leases.num_shared_leases == 1
    leases.table.check_integrity()
    # The first one ends (preempted, finished, released): the shared blocks stay with the second.
    assert leases.table.end(first, RequestStatus.ABORTED)
    assert leases.table.pool.num_used_blocks == 3
    leases.table.check_integrity()
    assert leases.table.end(second, RequestStatus.ABORTED)
    assert leases.table.pool.num_free_blocks == 16
    leases.table.check_integrity()


def test_a_third_completion_shares_with_either_and_the_blocks_free_with_the_last() -> None:
    leases = _manager()
    first = leases.allocate("r-0", len(PROMPT), 4, share_key="k")
    _commit(leases, first, PROMPT)
    second = leases.allocate("r-1", len(PROMPT), 4, share_key="k")
    _commit(leases, second, PROMPT)
    assert leases.table.end(first, RequestStatus.ABORTED)
    third = leases.allocate("r-2", len(PROMPT), 4, share_key="k")
    assert third.block_ids[:2] == second.block_ids[:2]
    assert [leases.table.pool.ref_counts[b] for b in third.block_ids[:2]] == [2, 2]
    leases.table.check_integrity()
    for lease in (second, third):
        assert leases.table.end(lease, RequestStatus.ABORTED)
        leases.table.check_integrity()
    assert leases.table.pool.num_free_blocks == 16


@pytest.mark.parametrize("case", ["uncommitted", "other key", "no key"])
def test_nothing_is_shared_before_the_commit_or_across_keys(case: str) -> None:
    leases = _manager()
    first = leases.allocate("r-0", len(PROMPT), 4, share_key="k")
    if case != "uncommitted":
        _commit(leases, first, PROMPT)
    key = {"uncommitted": "k", "other key": "k2", "no key": ""}[case]
    second = leases.allocate("r-1", len(PROMPT), 4, share_key=key)
    assert second.num_shared_blocks == 0
    assert not set(second.block_ids) & set(first.block_ids)
    leases.table.check_integrity()


def test_a_shared_lease_needs_room_only_for_its_own_blocks() -> None:
    leases = _manager(num_blocks=8)
    prompt = list(range(18))  # 4 full blocks and a partial one
    first = leases.allocate("r-0", len(prompt), 2, share_key="k")
    _commit(leases, first, prompt)
    with pytest.raises(PdserveError) as refused:
        leases.allocate("other", len(prompt), 2)  # 5 fresh blocks, 3 free
    assert refused.value.reason is ErrorReason.DECODE_CAPACITY_EXHAUSTED
    second = leases.allocate("r-1", len(prompt), 2, share_key="k")  # 1 fresh block
    assert second.num_shared_blocks == 4
    assert leases.table.pool.num_used_blocks == 6
    leases.table.check_integrity()


def test_the_integrity_check_catches_two_writers_and_a_leaked_reference() -> None:
    leases = _manager()
    first = leases.allocate("r-0", len(PROMPT), 4, share_key="k")
    _commit(leases, first, PROMPT)
    second = leases.allocate("r-1", len(PROMPT), 4, share_key="k")
    second.num_shared_blocks = 0  # as if it could write into the blocks the first one reads
    with pytest.raises(AssertionError, match="written by two leases"):
        leases.table.check_integrity()
    second.num_shared_blocks = 2
    leases.table.check_integrity()
    leases.table.pool.touch(second.block_ids[:1])  # a reference no lease holds
    with pytest.raises(AssertionError, match="leaked"):
        leases.table.check_integrity()
    leases.table.pool.free(second.block_ids[:1])
    second.block_ids.append(second.block_ids[0])  # a table holding one block twice
    with pytest.raises(AssertionError, match="holds a block twice"):
        leases.table.check_integrity()


def test_a_reschedule_shares_the_prompt_blocks_and_no_completion_tokens() -> None:
    leases = _manager()
    source = leases.allocate("r-0", len(PROMPT), 8, share_key="k")
    _commit(leases, source, PROMPT)
    # prompt + 5 completion tokens of another choice: its prompt's full blocks only
    assert len(share_grant(source, len(PROMPT) + 5, BLOCK_SIZE).block_ids) == 2
    # a lease for fewer tokens than the prompt shares no more than it fills
    assert len(share_grant(source, 5, BLOCK_SIZE).block_ids) == 1
    assert share_grant(None, 10, BLOCK_SIZE).block_ids == ()


def test_a_header_must_carry_the_shared_blocks_tokens() -> None:
    shared = tuple(PROMPT[:8])
    assert prefix_mismatch(shared, [*PROMPT, 1, 2]) is None
    assert prefix_mismatch((), [1]) is None
    assert "differ" in (prefix_mismatch(shared, [0, *PROMPT[1:]]) or "")
    assert "hold 8" in (prefix_mismatch(shared, PROMPT[:5]) or "")
