"""`decide`: what a setback leads to, by retry scope (never by message text), as a table."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
from support.gateway_cluster import instance_info

from pdserve.common.errors import ErrorReason, PdserveError, RetryScope
from pdserve.gateway.decisions import (
    Decision,
    Failed,
    GiveUp,
    Limit,
    Lost,
    Preempted,
    Reschedule,
    RescheduleCause,
    Retry,
    RetryPolicy,
    Setback,
    WaitForCapacity,
    decide,
    draining_id,
    unreachable_id,
)
from pdserve.gateway.fleet.instance import InstanceRole
from pdserve.gateway.progress import RequestState
from pdserve.gateway.routing.pair import Pair

PREFILL, DECODE = InstanceRole.PREFILL, InstanceRole.DECODE
PAIR = Pair(instance_info("p", PREFILL), instance_info("d", DECODE))
POLICY = RetryPolicy(max_attempts=3, preempt_retry_count=2)
FRESH = RequestState(num_attempts=1)
R = ErrorReason


def failed(
    reason: ErrorReason,
    role: InstanceRole = PREFILL,
    *,
    num_delivered_tokens: int = 0,
    retry_delay_s: float | None = None,
    **metadata: str,
) -> Failed:
    error = PdserveError(reason, "x", metadata, retry_delay_s=retry_delay_s)
    return Failed(role, PAIR, error, num_delivered_tokens)


def lost(role: InstanceRole) -> Lost:
    return Lost(role, PAIR, PdserveError(R.PEER_UNAVAILABLE, "connection lost"))


PREEMPTED = Preempted(PAIR, PdserveError(R.PREEMPTED, "preempted (out_of_blocks) after 3 tokens"))


@dataclass(frozen=True)
class Case:
    """One row: a setback in a state, and the decision it must lead to."""

    name: str
    setback: Setback
    decision: str  # "retry", "reschedule <cause>", "wait <full id>", "give up [<limit>]"
    excluded: str = ""  # instance ids excluded for the rest of the request
    avoided: str = ""  # instance ids avoided when another is available
    state: RequestState = FRESH
    policy: RetryPolicy = field(default=POLICY)


CASES = [
    # ANOTHER_PAIR / ANOTHER_DECODE / ANOTHER_PREFILL: the scope names what to leave out.
    Case("incompatible peer", failed(R.INCOMPATIBLE_PEER), "retry", "p d"),
    # ANOTHER_INSTANCE: the instance the error names, else the one whose stream failed.
    # INSTANCE_DRAINING: avoided (a draining instance leaves routing by itself; the same id
    # back from a restart may serve the request).
    Case("draining, unnamed, on the prefill", failed(R.INSTANCE_DRAINING), "retry", avoided="p"),
    Case("draining decode named", failed(R.INSTANCE_DRAINING, instanceId="d"), "retry",
         avoided="d"),
    Case("draining on the decode's stream", failed(R.INSTANCE_DRAINING, DECODE), "retry",
         avoided="d"),
    Case("prefill names itself", failed(R.PEER_UNAVAILABLE, instanceId="p"), "retry",
         avoided="p"),
    Case("decode address named", failed(R.INSTANCE_DRAINING, decodeAddress="d.invalid:1"),
         "retry", avoided="d"),
    # PEER_UNAVAILABLE: unreachable now, maybe back from a restart soon: avoided.
    Case("prefill cannot reach its decode", failed(R.PEER_UNAVAILABLE), "retry", avoided="p d"),
    Case("decode's stream unreachable", failed(R.PEER_UNAVAILABLE, DECODE), "retry", avoided="d"),
    Case("no healthy instances", failed(R.NO_HEALTHY_INSTANCES), "retry", "p"),
    # WHOLE_REQUEST: the same pair may serve it again.
    Case("lease expired in its transfer avoids both ends", failed(R.LEASE_EXPIRED, DECODE),
         "retry", avoided="p d"),
    Case("lease not found", failed(R.LEASE_NOT_FOUND, DECODE), "retry"),
    Case("rate limited", failed(R.RATE_LIMITED), "retry"),
    Case("corrupt transfer avoids both ends", failed(R.CACHE_SYNC_FAILED), "retry", avoided="p d"),
    # ONCE
    Case("internal, first time", failed(R.INTERNAL, DECODE), "retry"),
    Case("internal, second time", failed(R.INTERNAL, DECODE), "give up",
         state=replace(FRESH, has_used_once_retry=True)),
    # NEVER, REGISTER_AGAIN, and the request's own deadline
    Case("invalid request", failed(R.INVALID_REQUEST), "give up"),
    Case("prompt too long", failed(R.PROMPT_TOO_LONG), "give up"),
    Case("cancelled", failed(R.CANCELLED, DECODE), "give up"),
    Case("unknown model", failed(R.MODEL_NOT_FOUND), "give up"),
    Case("request too large", failed(R.REQUEST_TOO_LARGE), "give up"),
    Case("unauthenticated", failed(R.UNAUTHENTICATED), "give up"),
    Case("register again", failed(R.INSTANCE_NOT_REGISTERED), "give up"),
    Case("deadline exceeded", failed(R.DEADLINE_EXCEEDED, DECODE), "give up"),
    # RESCHEDULE: preempted, by notice or by status; a lost decode (avoided, not excluded: the
    # registry keeps a dead one out, and the same id back from a restart may serve it).
    Case("preemption notice", PREEMPTED, "reschedule preempted"),
    Case("preempted status", failed(R.PREEMPTED, DECODE), "reschedule preempted"),
    Case("preempted, avoid that decode", PREEMPTED, "reschedule preempted", avoided="d",
         policy=replace(POLICY, preempt_retry_exclude_decode=True)),
    Case("lost decode", lost(DECODE), "reschedule decode_lost", avoided="d"),
    Case("lost prefill", lost(PREFILL), "retry", avoided="p"),
    # No room: wait for it (that instance marked full), whatever max_attempts says; nothing
    # is excluded (it has room again once work there ends).
    Case("decode full", failed(R.DECODE_CAPACITY_EXHAUSTED, instanceId="d"), "wait d",
         state=replace(FRESH, num_failures=2)),
    Case("decode full after the first token",
         failed(R.DECODE_CAPACITY_EXHAUSTED, num_delivered_tokens=3, retry_delay_s=2.0),
         "wait d", state=replace(FRESH, num_failures=2)),
    Case("prefill overloaded", failed(R.PREFILL_OVERLOADED), "wait p"),
    # The limits
    Case("max_attempts reached", failed(R.LEASE_NOT_FOUND), "give up max_attempts",
         state=replace(FRESH, num_failures=2)),
    Case("max_attempts reached by a lost prefill", lost(PREFILL), "give up max_attempts",
         state=replace(FRESH, num_failures=2)),
    Case("reschedules used up", PREEMPTED, "give up preempt_retry_count",
         state=replace(FRESH, num_reschedules=2)),
    Case("reschedules used up by a lost decode", lost(DECODE), "give up preempt_retry_count",
         state=replace(FRESH, num_reschedules=2)),
    Case("exclusions add up", failed(R.INCOMPATIBLE_PEER), "retry", "p q d",
         state=replace(FRESH, excluded_prefill_ids=frozenset({"q"}),
                       excluded_decode_ids=frozenset({"d"}))),
]  # fmt: skip


def _summary(decision: Decision) -> tuple[str, str, str]:
    """(decision, excluded ids, avoided ids), as the table writes them."""
    if isinstance(decision, GiveUp):
        limit = f" {decision.limit.value}" if decision.limit else ""
        return f"give up{limit}", "", ""
    if isinstance(decision, Reschedule):
        kind = f"reschedule {decision.cause.value}"
    elif isinstance(decision, WaitForCapacity):
        kind = f"wait {decision.instance_id}"
    else:
        kind = "retry"
    state = decision.state
    excluded = sorted(state.excluded_prefill_ids) + sorted(state.excluded_decode_ids)
    avoided = sorted(state.avoided_prefill_ids) + sorted(state.avoided_decode_ids)
    return kind, " ".join(excluded), " ".join(avoided)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_decide(case: Case) -> None:
    decision = decide(case.setback, case.state, case.policy)
    expected_excluded = case.excluded if not case.decision.startswith("give up") else ""
    assert _summary(decision) == (case.decision, expected_excluded, case.avoided)
    before = case.state
    if isinstance(decision, GiveUp):
        assert decision.error is case.setback.error
        return
    after = decision.state
    assert after.last_error is case.setback.error
    assert after.num_attempts == before.num_attempts
    # Each kind of decision counts against its own limit, and only against that one.
    num_failures = before.num_failures + isinstance(decision, Retry)
    num_reschedules = before.num_reschedules + isinstance(decision, Reschedule)
    assert (after.num_failures, after.num_reschedules) == (num_failures, num_reschedules)


def test_the_table_covers_every_retry_scope() -> None:
    scopes = {case.setback.error.retry_scope for case in CASES}
    assert scopes == set(RetryScope)
    kinds = {type(case.setback) for case in CASES}
    assert kinds == {Failed, Lost, Preempted}


def test_once_is_used_once_per_request() -> None:
    first = decide(failed(R.INTERNAL), FRESH, POLICY)
    assert isinstance(first, Retry) and first.state.has_used_once_retry
    second = decide(failed(R.INTERNAL), first.state, POLICY)
    assert isinstance(second, GiveUp) and second.limit is None


def test_a_request_runs_out_of_attempts_then_of_reschedules() -> None:
    state, decisions = FRESH, []
    for setback in [lost(DECODE), failed(R.LEASE_EXPIRED), PREEMPTED, failed(R.LEASE_EXPIRED),
                    PREEMPTED, failed(R.LEASE_EXPIRED)]:  # fmt: skip
        decision = decide(setback, state, POLICY)
        decisions.append(_summary(decision)[0])
        if isinstance(decision, GiveUp):
            break
        state = decision.state
    assert decisions == [
        "reschedule decode_lost",
        "retry",
        "reschedule preempted",
        "retry",
        "give up preempt_retry_count",
    ]
    assert isinstance(decide(failed(R.LEASE_EXPIRED), state, POLICY), GiveUp)


def test_causes_and_limits_are_the_metric_labels_and_flags() -> None:
    assert [cause.value for cause in RescheduleCause] == ["preempted", "decode_lost"]
    assert [limit.value for limit in Limit] == ["max_attempts", "preempt_retry_count"]


def test_a_corrupt_transfer_prefers_another_pair_but_does_not_require_one() -> None:
    decision = decide(failed(R.CACHE_SYNC_FAILED), FRESH, POLICY)
    assert isinstance(decision, Retry)
    assert decision.state.exclusions() == [
        ({"p"}, {"d"}),  # another prefill and another decode, if there are
        (set(), {"d"}),
        ({"p"}, set()),
        (set(), set()),  # else the same pair again
    ]


def test_exclusions_always_keep_the_excluded_instances() -> None:
    assert FRESH.exclusions() == [(set(), set())]
    state = replace(
        FRESH,
        excluded_prefill_ids=frozenset({"p-dead"}),
        avoided_decode_ids=frozenset({"d-preempting"}),
    )
    assert state.exclusions() == [({"p-dead"}, {"d-preempting"}), ({"p-dead"}, set())]


@pytest.mark.parametrize(
    "setting", [{"max_attempts": 0}, {"preempt_retry_count": -1}], ids=lambda s: next(iter(s))
)
def test_bad_policies_are_refused(setting: dict[str, int]) -> None:
    with pytest.raises(ValueError, match=next(iter(setting))):
        RetryPolicy(**setting)


def test_unreachable_instances_are_the_lost_and_the_blamed_peer() -> None:
    assert unreachable_id(lost(DECODE)) == "d"
    assert unreachable_id(lost(PREFILL)) == "p"
    assert unreachable_id(failed(R.PEER_UNAVAILABLE)) == "d"  # a prefill that cannot reach it
    assert unreachable_id(failed(R.PEER_UNAVAILABLE, instanceId="p")) == "p"
    assert unreachable_id(failed(R.INSTANCE_DRAINING, DECODE)) is None
    assert unreachable_id(PREEMPTED) is None


def test_a_draining_instance_is_the_one_that_said_so() -> None:
    assert draining_id(failed(R.INSTANCE_DRAINING)) == "p"  # a prefill going away
    assert draining_id(failed(R.INSTANCE_DRAINING, DECODE)) == "d"
    assert draining_id(failed(R.INSTANCE_DRAINING, instanceId="d")) == "d"
    assert draining_id(failed(R.PEER_UNAVAILABLE)) is None
    assert draining_id(lost(PREFILL)) is None
    assert draining_id(PREEMPTED) is None
