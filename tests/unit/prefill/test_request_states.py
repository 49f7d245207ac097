"""The prefill request's state machine: every legal and illegal transition."""

from __future__ import annotations

import itertools

import pytest

from pdserve.common.generation import SamplingParams
from pdserve.common.transitions import IllegalTransition
from pdserve.prefill.request import Request, RequestStatus

S = RequestStatus

# (from, to) pairs the state machine allows; every other pair is illegal.
LEGAL = {
    (S.QUEUED, S.PREPARING),
    (S.QUEUED, S.PREFILLING),  # no lease: the first token ends the request
    (S.PREPARING, S.PREFILLING),
    (S.PREFILLING, S.TRANSFERRING),
    (S.PREFILLING, S.FINISHED),
    (S.TRANSFERRING, S.HANDED_OFF),
    *((s, end) for s in (S.QUEUED, S.PREPARING, S.PREFILLING, S.TRANSFERRING)
      for end in (S.FAILED, S.ABORTED)),
}  # fmt: skip
PAIRS = list(itertools.product(RequestStatus, RequestStatus))


def _request_in(status: RequestStatus) -> Request:
    request = Request("req", [1, 2, 3], 3, SamplingParams(), seed=0, decode_address="d:1")
    request.status = status
    return request


@pytest.mark.parametrize(("current", "new"), PAIRS, ids=[f"{a.name}->{b.name}" for a, b in PAIRS])
def test_transition_table(current: RequestStatus, new: RequestStatus) -> None:
    request = _request_in(current)
    is_legal = (current, new) in LEGAL
    assert request.can_move_to(new) is is_legal
    if is_legal:
        request.move_to(new)
        assert request.status is new
    else:
        with pytest.raises(IllegalTransition):
            request.move_to(new)
        assert request.status is current


@pytest.mark.parametrize("current", list(RequestStatus))
@pytest.mark.parametrize("ending", [S.FAILED, S.ABORTED])
def test_end_fails_or_aborts_once(current: RequestStatus, ending: RequestStatus) -> None:
    request = _request_in(current)
    assert request.end(ending) is not current.is_terminal
    assert request.status is (current if current.is_terminal else ending)
    assert request.end(ending) is False


@pytest.mark.parametrize("status", [S.HANDED_OFF, S.FINISHED, S.PREFILLING])
def test_end_takes_only_failed_or_aborted(status: RequestStatus) -> None:
    with pytest.raises(IllegalTransition):
        _request_in(S.TRANSFERRING).end(status)
