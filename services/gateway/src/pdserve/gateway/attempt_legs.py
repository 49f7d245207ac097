"""The legs of one attempt on a prefill/decode pair, each a function of its own.

`prefill_leg` runs ``Prefill`` -> ``FirstToken`` -> ``HandedOff``; `decode_leg` runs
``Generate(lease)`` -> token batches -> ``Finished`` or a preemption notice (`follow_decode`,
which also attaches to a request another gateway left on a decode); `clean_up` gives
back what they left held (a prefill request to abort, a lease to release). Each takes the
request (`ActiveRequest`, whose progress the tokens advance) and the `Attempt`, on which a leg
records what it leaves held; the legs reach the instances through `Peers`.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.context import Context

from pdserve.gateway.active_request import ActiveRequest
from pdserve.gateway.cleanups import Cleanups
from pdserve.gateway.fleet.backend import (
    Backend,
    DecodeEvent,
    FinishedEvent,
    FirstTokenEvent,
    HandedOffEvent,
    PreemptionEvent,
    PrefillCall,
    PrefillEvent,
)
from pdserve.gateway.fleet.instance import InstanceRole
from pdserve.gateway.progress import CompletionProgress
from pdserve.gateway.relay import AttemptFailed, LossWatch, connection_lost, relay
from pdserve.gateway.request import Placement, TokenChunk
from pdserve.gateway.routing.pair import Pair

PREFILL, DECODE = InstanceRole.PREFILL, InstanceRole.DECODE

Settle = Callable[[Pair, InstanceRole, bool], None]


@dataclass(frozen=True)
class Peers:
    """How the legs reach the instances; the same for every attempt.

    Attributes:
        backend: Calls to prefill and decode instances.
        loss_watch: Interrupts the streams of instances the registry lost.
        end_grace_s: How long a stream may go on once the gateway saw the completion end.
        settle: Told when an attempt is done with one of its instances (`Router.settle`),
            with whether the work ran there.
    """

    backend: Backend
    loss_watch: LossWatch
    end_grace_s: float
    settle: Settle

    def relay(
        self,
        role: InstanceRole,
        stream: AsyncGenerator[PrefillEvent, None] | AsyncGenerator[DecodeEvent, None],
        progress: CompletionProgress,
        watched: dict[str, InstanceRole],
    ) -> AsyncGenerator[TokenChunk | PrefillEvent | DecodeEvent, None]:
        """`pdserve.gateway.relay.relay` of `stream`, watching the instances `watched`."""
        return relay(role, stream, progress, self.loss_watch, watched, self.end_grace_s)


@dataclass
class Attempt:
    """One attempt: its pair and span, and what its legs left held.

    Attributes:
        pair: Where it runs.
        span: Its span (first token and preemption become its events).
        owes_abort: The prefill may still hold the request (AbortRequest on leaving).
        lease_id: The decode lease the attempt holds (ReleaseLease on leaving), if any.
        has_run: The prompt was computed (the decode held a lease): the work ran there.
        is_first_token_attempt: It delivered the request's first token.
        handed_off: The prefill's hand-off, once it came.
        finished: The instance's end, once it came.
        preempted: The decode's preemption notice, if one came.
        context: The trace context under its span (its calls become its children).
    """

    pair: Pair
    span: trace.Span = trace.INVALID_SPAN
    owes_abort: bool = True
    lease_id: str | None = None
    has_run: bool = False
    is_first_token_attempt: bool = False
    handed_off: HandedOffEvent | None = None
    finished: FinishedEvent | None = None
    preempted: PreemptionEvent | None = None
    context: Context = field(init=False)

    def __post_init__(self) -> None:
        self.context = trace.set_span_in_context(self.span)


def prefill_call(active: ActiveRequest, attempt: Attempt) -> PrefillCall:
    """The attempt's Prefill call: the prompt and the tokens delivered so far."""
    request, pair = active.request, attempt.pair
    return PrefillCall(
        request_id=request.request_id,
        token_ids=active.progress.continuation_token_ids(),
        num_prompt_tokens=len(request.prompt_token_ids),
        sampling=active.continuation_sampling(),
        decode_address=pair.decode.address,
        decode_instance_id=pair.decode.instance_id,
        trace_context=attempt.context,
        share_key=request.share_key,
    )


async def prefill_leg(
    active: ActiveRequest, attempt: Attempt, peers: Peers
) -> AsyncGenerator[TokenChunk, None]:
    """Prefill to the hand-off (or the end); yields the first token.

    Raises:
        AttemptFailed: The prefill stream failed or ended without its terminal event.
    """
    pair, timeline = attempt.pair, active.timeline
    call = prefill_call(active, attempt)
    timeline.on_prefill_call()
    prefill = peers.backend.prefill(pair.prefill.address, call, active.remaining_s())
    # NOTE: until the hand-off, the attempt waits on the decode too (allocation, KV).
    watched = {pair.prefill.instance_id: PREFILL, pair.decode.instance_id: DECODE}
    try:
        try:
            async with aclosing(peers.relay(PREFILL, prefill, active.progress, watched)) as events:
                async for event in events:
                    if isinstance(event, TokenChunk):
                        index = {"pdserve.completion_index": event.first_index}
                        attempt.span.add_event("first_token", index)
                        yield event
                    elif isinstance(event, FirstTokenEvent):
                        attempt.has_run = True  # computed, with a lease: off the prefill's queue
                        peers.settle(pair, PREFILL, True)
                        attempt.is_first_token_attempt = timeline.on_first_token(event.phases)
                    elif isinstance(event, HandedOffEvent):
                        _on_handed_off(active, attempt, event)
                    elif isinstance(event, FinishedEvent):
                        attempt.finished = event
                        break
        finally:
            peers.settle(pair, PREFILL, attempt.has_run)
        if attempt.finished is None and attempt.handed_off is None:
            raise connection_lost(PREFILL, "the prefill stream ended without a terminal event")
    except AttemptFailed as failed:
        # NOTE: a prefill that reported the failure itself has already ended the request and
        # released its lease. An AbortRequest now would arrive late and could cancel the
        # retry, which reuses the request id on the same prefill.
        attempt.owes_abort = not failed.failure.is_from_server
        raise
    attempt.owes_abort = False


def _on_handed_off(active: ActiveRequest, attempt: Attempt, event: HandedOffEvent) -> None:
    attempt.handed_off, attempt.lease_id = event, event.lease_id
    if active.resumable is not None:
        target = attempt.pair.decode
        active.resumable.on_placed(Placement(target.instance_id, target.address, event.lease_id))
    if attempt.is_first_token_attempt:
        active.timeline.on_handed_off(event.phases)


DecodeEnd = FinishedEvent | PreemptionEvent


async def follow_decode(
    active: ActiveRequest,
    peers: Peers,
    placement: Placement,
    context: Context,
    on_end: Callable[[DecodeEnd], None],
    *,
    resume: bool = False,
) -> AsyncGenerator[TokenChunk, None]:
    """``Generate`` on the decode `placement` names, from its lease to the end or a preemption
    notice: the tokens new to `active`'s progress, and those a notice carries.

    Args:
        active: The request; its progress takes the tokens.
        peers: How to reach the decode.
        placement: The decode and the lease.
        context: The trace context the call runs under.
        on_end: Told the terminal event as soon as it comes (the decode let go of the lease).
        resume: Attach to a resumable request another gateway left there (the decode replays
            its tokens first).

    Raises:
        AttemptFailed: The stream failed.
    """
    decode = peers.backend.generate(
        placement.decode_address,
        active.request_id,
        placement.lease_id,
        active.remaining_s(),
        context,
        resumable=active.resumable is not None,
        resume=resume,
    )
    end: DecodeEnd | None = None
    watched = {placement.decode_instance_id: DECODE}
    async with aclosing(peers.relay(DECODE, decode, active.progress, watched)) as events:
        async for event in events:
            if isinstance(event, TokenChunk):
                yield event
            elif isinstance(event, PreemptionEvent | FinishedEvent):
                end = event
                on_end(event)
                break
    if isinstance(end, PreemptionEvent):
        accepted = active.progress.accept(end.generated_token_ids, 0)
        if accepted.chunk is not None:
            yield accepted.chunk


async def decode_leg(
    active: ActiveRequest, attempt: Attempt, peers: Peers
) -> AsyncGenerator[TokenChunk, None]:
    """Generate on the decode from the hand-off to its end or a preemption notice.

    Raises:
        AttemptFailed: The decode stream failed or ended without its terminal event.
    """
    handed_off, progress = attempt.handed_off, active.progress
    if handed_off is None or progress.finish_reason is not None:
        return

    def ended(event: DecodeEnd) -> None:
        attempt.lease_id = None  # the decode let go of it
        if isinstance(event, FinishedEvent):
            attempt.finished = event
            return
        attempt.preempted = event
        attempt.span.add_event(
            "preemption",
            {"pdserve.reason": str(event.reason),
             "pdserve.num_generated_tokens": event.num_generated_tokens},
        )  # fmt: skip

    target = attempt.pair.decode
    placement = Placement(target.instance_id, target.address, handed_off.lease_id)
    async with aclosing(follow_decode(active, peers, placement, attempt.context, ended)) as chunks:
        async for chunk in chunks:
            yield chunk
    if attempt.finished is None and attempt.preempted is None and progress.finish_reason is None:
        raise connection_lost(DECODE, "the decode stream ended without a terminal event")


def clean_up(active: ActiveRequest, attempt: Attempt, cleanups: Cleanups) -> None:
    """Gives back what the attempt still holds: the prefill request, the lease (kept for a
    resumable request its gateway left)."""
    context = attempt.context
    if attempt.owes_abort:
        cleanups.abort(attempt.pair.prefill.address, active.request_id, context)
    if attempt.lease_id is not None and not active.is_left:
        address = attempt.pair.decode.address
        cleanups.release(address, attempt.lease_id, active.request_id, context)
