"""The decode request's state machine: every legal and illegal transition, blocks freed once."""

from __future__ import annotations

import itertools

import pytest

from pdserve.common.transitions import IllegalTransition
from pdserve.decode.lease_state import RequestStatus
from pdserve.decode.request import DecodeRequest
from pdserve.engine.block_pool import BlockPool

S = RequestStatus

# (from, to) pairs the state machine allows; every other pair is illegal.
LEGAL = {
    (S.ALLOCATED, S.SYNCING),
    (S.SYNCING, S.COMMITTED),
    (S.COMMITTED, S.RUNNING),
    *((s, end) for s in (S.ALLOCATED, S.SYNCING, S.COMMITTED, S.RUNNING)
      for end in (S.ABORTED, S.EXPIRED, S.FAILED)),
    (S.RUNNING, S.FINISHED),
    (S.RUNNING, S.PREEMPTED),
}  # fmt: skip
PAIRS = list(itertools.product(RequestStatus, RequestStatus))


def _request_in(status: RequestStatus, pool: BlockPool) -> DecodeRequest:
    request = DecodeRequest("lease", "req", pool.allocate(2), 20, 4, expires_at=0.0)
    request.status = status
    return request


@pytest.mark.parametrize(("current", "new"), PAIRS, ids=[f"{a.name}->{b.name}" for a, b in PAIRS])
def test_transition_table(current: RequestStatus, new: RequestStatus) -> None:
    pool = BlockPool(8)
    request = _request_in(current, pool)
    is_legal = (current, new) in LEGAL
    assert request.can_move_to(new) is is_legal
    if current.is_terminal:
        # An ended request stays ended: a second ending is a no-op, anything else a bug.
        if new.is_terminal:
            assert request.end(new, pool) is False
            assert request.status is current
        else:
            with pytest.raises(IllegalTransition):
                request.move_to(new)
        return
    if not is_legal:
        with pytest.raises(IllegalTransition):
            request.end(new, pool) if new.is_terminal else request.move_to(new)
        assert request.status is current and pool.num_free_blocks == 6
    elif new.is_terminal:
        assert request.end(new, pool) is True
        assert (request.status, request.block_ids, pool.num_free_blocks) == (new, [], 8)
        assert request.ended_at is not None
    else:
        request.move_to(new)
        assert request.status is new and pool.num_free_blocks == 6
    pool.check_integrity()


@pytest.mark.parametrize("ending", [s for s in RequestStatus if s.is_terminal])
def test_every_ending_frees_the_blocks_exactly_once(ending: RequestStatus) -> None:
    pool = BlockPool(8)
    request = _request_in(S.RUNNING, pool)
    assert request.end(ending, pool) is True
    assert request.end(S.ABORTED, pool) is False
    assert pool.num_free_blocks == 8
    pool.check_integrity()


def test_the_happy_path_walks_the_states_in_order() -> None:
    pool = BlockPool(8)
    request = _request_in(S.ALLOCATED, pool)
    for status in (S.SYNCING, S.COMMITTED, S.RUNNING):
        request.move_to(status)
    assert request.end(S.FINISHED, pool) is True
    assert request.status is S.FINISHED and pool.num_free_blocks == 8
