"""What follows an attempt: its outcome as a value, and the one rule that decides what next.

An attempt that does not finish the completion ends with a *setback*:

* `Preempted`: the decode preempted the request (every token it generated was delivered);
* `Failed`: an instance answered with an error status;
* `Lost`: the connection to an instance was lost (refused or reset, a stream that ended without
  its terminal event, an instance that stopped heartbeating).

`decide(setback, state, policy)` is a pure function of those values: it returns a `Decision`
carrying the request's next `RequestState`, and the orchestrator carries it out. Errors are
classified by their reason's retry scope, never by message text:

* preempted, or a PREEMPTED status (RESCHEDULE): reschedule with the delivered tokens (avoiding
  that decode with ``preempt_retry_exclude_decode``); a lost decode: reschedule, preferring
  another decode. Both count against ``preempt_retry_count``.
* a lost prefill: retry, preferring another prefill. A lost instance, one that another could
  not reach (PEER_UNAVAILABLE) and one that is draining (INSTANCE_DRAINING) are only
  *avoided*, not excluded (a prefill that could not reach its decode: both, as the path
  between them may be what failed): the registry keeps each out of routing until it serves again
  (`unreachable_id` marks the unreachable), and the one that comes back (a restart under the
  same id) may take the request when nothing else can.
  When no pair is alive at all, a request that had a setback waits for one to register
  (`pdserve.gateway.peer_wait`), up to ``peer_wait_s``.
* ANOTHER_PAIR / _DECODE / _PREFILL / _INSTANCE: retry
  without the instance(s) the scope blames; WHOLE_REQUEST: retry as is (CACHE_SYNC_FAILED and
  LEASE_EXPIRED avoid both ends); ONCE: retry as is, once. All count against ``max_attempts``.
* DECODE_CAPACITY_EXHAUSTED, PREFILL_OVERLOADED (an instance had no room after all): wait for
  room in the admission queue (`pdserve.gateway.routing.queue`), that instance marked full
  until it reports again or work there ends. Not counted against ``max_attempts``: the queue's
  bounds (a request with no token yet) or the request timeout (one already streaming) bound it.
* DEADLINE_EXCEEDED, NEVER, REGISTER_AGAIN: give up with the error.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import TypeAlias

from pdserve.common.config import check_ranges, setting
from pdserve.common.errors import ErrorReason, PdserveError, RetryScope
from pdserve.gateway.fleet.instance import InstanceRole
from pdserve.gateway.progress import RequestState
from pdserve.gateway.routing.pair import Pair


@dataclass(frozen=True)
class RetryPolicy:
    """How hard the orchestrator tries.

    Attributes:
        max_attempts: Failed attempts (retryable errors) after which a request fails.
        preempt_retry_count: Reschedules (preemption, lost decode) a request may take.
        preempt_retry_exclude_decode: Prefer another decode after a preemption.
        cleanup_timeout_s: Deadline of each AbortRequest / ReleaseLease sent while cleaning up.
        end_grace_s: How long to wait for a stream's terminal event once the gateway has seen
            the completion end (stop token, max_tokens) before releasing the lease itself.
        peer_wait_s: How long a request that had a setback (a lost instance, a failed attempt)
            waits for a prefill/decode pair to register when none is alive, before it fails;
            0 fails at once. The request's deadline bounds it too.
    """

    max_attempts: int = setting(3, min=1)
    preempt_retry_count: int = setting(4, min=0)
    preempt_retry_exclude_decode: bool = False
    cleanup_timeout_s: float = setting(2.0, gt=0)
    end_grace_s: float = setting(1.0, min=0)
    peer_wait_s: float = setting(30.0, min=0)

    def __post_init__(self) -> None:
        check_ranges(self)


@dataclass(frozen=True)
class Preempted:
    """The decode of `pair` preempted the request; its error says why and after how much."""

    pair: Pair
    error: PdserveError


@dataclass(frozen=True)
class Failed:
    """The `role` instance of `pair` answered with an error status.

    Attributes:
        num_delivered_tokens: Completion tokens the consumer had when the attempt ended.
    """

    role: InstanceRole
    pair: Pair
    error: PdserveError
    num_delivered_tokens: int = 0


@dataclass(frozen=True)
class Lost:
    """The connection to the `role` instance of `pair` was lost (``error``: PEER_UNAVAILABLE)."""

    role: InstanceRole
    pair: Pair
    error: PdserveError

    @property
    def instance_id(self) -> str:
        """The instance that was lost."""
        info = self.pair.prefill if self.role is InstanceRole.PREFILL else self.pair.decode
        return info.instance_id


Setback: TypeAlias = Preempted | Failed | Lost


class RescheduleCause(enum.Enum):
    """Why a request continues elsewhere (the ``cause`` label of the reschedules metric)."""

    PREEMPTED = "preempted"
    DECODE_LOST = "decode_lost"


class Limit(enum.Enum):
    """The `RetryPolicy` limit a request ran out of."""

    ATTEMPTS = "max_attempts"
    RESCHEDULES = "preempt_retry_count"


@dataclass(frozen=True)
class Retry:
    """Route again (under `state`'s exclusions) and start another attempt from the same point."""

    state: RequestState


@dataclass(frozen=True)
class WaitForCapacity:
    """The `role` instance of `pair` had no room: mark it full and wait in the admission
    queue for a pair with room."""

    state: RequestState
    role: InstanceRole
    pair: Pair

    @property
    def instance_id(self) -> str:
        """The instance that had no room."""
        return self.pair.instance(self.role).instance_id


@dataclass(frozen=True)
class Reschedule:
    """Continue elsewhere: prefill prompt + delivered tokens, then decode on."""

    state: RequestState
    cause: RescheduleCause


@dataclass(frozen=True)
class GiveUp:
    """End the request with `error` (`limit`: the policy limit reached, if that is why)."""

    error: PdserveError
    limit: Limit | None = None


_NO_ROOM = {
    ErrorReason.DECODE_CAPACITY_EXHAUSTED: InstanceRole.DECODE,
    ErrorReason.PREFILL_OVERLOADED: InstanceRole.PREFILL,
}

Decision: TypeAlias = Retry | WaitForCapacity | Reschedule | GiveUp

# NOTE: reasons whose instance the registry itself keeps out of routing until it serves again.
_KEPT_OUT_BY_THE_REGISTRY = frozenset({ErrorReason.PEER_UNAVAILABLE, ErrorReason.INSTANCE_DRAINING})


def decide(setback: Setback, state: RequestState, policy: RetryPolicy) -> Decision:
    """What a request does after a setback (see the module's table).

    Args:
        setback: How the attempt ended.
        state: The request's bookkeeping before the setback (its attempt counted).
        policy: The limits.

    Returns:
        The decision, with the next `RequestState` unless it gives up.
    """
    if isinstance(setback, Preempted):
        return _reschedule(setback.pair, setback.error, RescheduleCause.PREEMPTED, state, policy)
    error = setback.error
    if error.reason is ErrorReason.DEADLINE_EXCEEDED:
        return GiveUp(error)
    if isinstance(setback, Lost):
        # NOTE: the instance we called is gone (or going): the registry keeps it out of
        # routing until it answers again, so it is avoided here, not excluded (the same id
        # back from a restart may serve the request when no other can).
        if setback.role is InstanceRole.DECODE:
            cause = RescheduleCause.DECODE_LOST
            return _reschedule(setback.pair, error, cause, state, policy)
        return _count_failure(error, _avoid(state, setback.pair, InstanceRole.PREFILL), policy)
    scope = error.retry_scope
    if scope is RetryScope.RESCHEDULE:
        return _reschedule(setback.pair, error, RescheduleCause.PREEMPTED, state, policy)
    if scope in (RetryScope.NEVER, RetryScope.REGISTER_AGAIN):
        return GiveUp(error)
    if error.reason in _NO_ROOM:
        # NOTE: room frees within seconds under a burst: a request waits for it in the
        # admission queue instead of failing (its bounds, or the request timeout, bound that).
        role = _NO_ROOM[error.reason]
        return WaitForCapacity(replace(state, last_error=error), role, setback.pair)
    if scope is RetryScope.ONCE:
        if state.has_used_once_retry:
            return GiveUp(error)
        return _count_failure(error, replace(state, has_used_once_retry=True), policy)
    blamed = _blamed_roles(setback)
    if error.reason in _KEPT_OUT_BY_THE_REGISTRY:
        # NOTE: an instance another could not reach is marked unreachable in the registry
        # (`unreachable_id`) until it answers again; a draining one deregistered (or reports
        # draining). Either is avoided here like a lost one: the same id back from a restart
        # may serve the request.
        for role in blamed:
            state = _avoid(state, setback.pair, role)
        if (
            error.reason is ErrorReason.PEER_UNAVAILABLE
            and setback.role is InstanceRole.PREFILL
            and blamed == {InstanceRole.DECODE}
        ):
            # NOTE: a prefill that could not reach its decode: the decode may be gone, or the
            # path between the two (the prefill's own link just back, its channels still
            # connecting again). The retry prefers another prefill too: an idle prefill that
            # was just cut off is otherwise the one routing picks for every retry.
            state = _avoid(state, setback.pair, InstanceRole.PREFILL)
    else:
        state = _exclude(state, setback.pair, blamed)
    if error.reason in (ErrorReason.CACHE_SYNC_FAILED, ErrorReason.LEASE_EXPIRED):
        # NOTE: KV that failed its checksum may come from either end (memory, NIC), and a
        # lease that expired before its KV was all sent was filled too slowly (a slow link
        # between the two, a busy prefill): the retry prefers another prefill and decode when
        # there are any (the same pair again fails the same way, until max_attempts).
        state = replace(
            state,
            avoided_prefill_ids=state.avoided_prefill_ids | {setback.pair.prefill.instance_id},
            avoided_decode_ids=state.avoided_decode_ids | {setback.pair.decode.instance_id},
        )
    return _count_failure(error, state, policy)


def unreachable_id(setback: Setback) -> str | None:
    """The instance a setback says could not be reached (the registry takes it out of routing
    until its next heartbeat): a lost one, or the one a PEER_UNAVAILABLE error blames."""
    if isinstance(setback, Lost):
        return setback.instance_id
    if isinstance(setback, Failed) and setback.error.reason is ErrorReason.PEER_UNAVAILABLE:
        return _blamed_instance(setback)
    return None


def draining_id(setback: Setback) -> str | None:
    """The instance a setback says is going away (INSTANCE_DRAINING: it stops admitting, or
    lost a rank and is going down): the registry takes it out of routing until a heartbeat
    says otherwise, so that a retry waits for another instance (or this one started again)
    instead of meeting it again before it deregistered."""
    if isinstance(setback, Failed) and setback.error.reason is ErrorReason.INSTANCE_DRAINING:
        return _blamed_instance(setback)
    return None


def _blamed_instance(setback: Failed) -> str | None:
    """The one instance of the pair the error's retry scope blames (None: both or neither)."""
    roles = _blamed_roles(setback)
    return setback.pair.instance(roles.pop()).instance_id if len(roles) == 1 else None


def _reschedule(
    pair: Pair,
    error: PdserveError,
    cause: RescheduleCause,
    state: RequestState,
    policy: RetryPolicy,
) -> Decision:
    if state.num_reschedules >= policy.preempt_retry_count:
        return GiveUp(error, Limit.RESCHEDULES)
    if cause is RescheduleCause.DECODE_LOST or policy.preempt_retry_exclude_decode:
        state = _avoid(state, pair, InstanceRole.DECODE)
    return Reschedule(
        replace(state, num_reschedules=state.num_reschedules + 1, last_error=error), cause
    )


def _count_failure(error: PdserveError, state: RequestState, policy: RetryPolicy) -> Decision:
    if state.num_failures + 1 >= policy.max_attempts:
        return GiveUp(error, Limit.ATTEMPTS)
    return Retry(replace(state, num_failures=state.num_failures + 1, last_error=error))


def _blamed_roles(setback: Failed) -> set[InstanceRole]:
    """The instance(s) of the pair that an error's retry scope says to leave out."""
    error, pair = setback.error, setback.pair
    scope = error.retry_scope
    if scope is RetryScope.ANOTHER_PAIR:
        return {InstanceRole.PREFILL, InstanceRole.DECODE}
    if scope is RetryScope.ANOTHER_DECODE:
        return {InstanceRole.DECODE}
    if scope is RetryScope.ANOTHER_PREFILL:
        return {InstanceRole.PREFILL}
    if scope is not RetryScope.ANOTHER_INSTANCE:
        return set()
    blamed_id = error.metadata.get("instanceId")
    if (
        blamed_id == pair.decode.instance_id
        or setback.role is InstanceRole.DECODE
        or error.metadata.get("decodeAddress") == pair.decode.address
    ):
        return {InstanceRole.DECODE}
    if blamed_id == pair.prefill.instance_id:
        return {InstanceRole.PREFILL}
    if error.reason is ErrorReason.PEER_UNAVAILABLE:
        return {InstanceRole.DECODE}  # a prefill that cannot reach a peer means its decode
    return {InstanceRole.PREFILL}


def _avoid(state: RequestState, pair: Pair, role: InstanceRole) -> RequestState:
    """`state` preferring instances other than the `role` instance of `pair`."""
    if role is InstanceRole.PREFILL:
        return replace(
            state, avoided_prefill_ids=state.avoided_prefill_ids | {pair.prefill.instance_id}
        )
    return replace(state, avoided_decode_ids=state.avoided_decode_ids | {pair.decode.instance_id})


def _exclude(state: RequestState, pair: Pair, roles: set[InstanceRole]) -> RequestState:
    """`state` with the `roles` instances of `pair` excluded."""
    if InstanceRole.PREFILL in roles:
        excluded = state.excluded_prefill_ids | {pair.prefill.instance_id}
        state = replace(state, excluded_prefill_ids=excluded)
    if InstanceRole.DECODE in roles:
        excluded = state.excluded_decode_ids | {pair.decode.instance_id}
        state = replace(state, excluded_decode_ids=excluded)
    return state
