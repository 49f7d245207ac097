"""One attempt of a request on a prefill/decode pair, as one object (`Attempt`).

An attempt is: ``Prefill`` on a prefill P (targeting decode D) -> ``FirstToken`` (delivered at
once) -> ``HandedOff{lease}`` -> ``DecodeService.Generate(lease)`` on D -> token batches ->
``Finished``. `Attempt.start` counts it and opens its span; the orchestrator then runs its
steps in turn: `Attempt.prefill` (to the hand-off, yielding the first token), `Attempt.decode`
(from the lease to the end or a preemption notice), and `Attempt.release`, which gives back
what they left held (a prefill request to abort, a lease to release: `pdserve.gateway.cleanups`).
How it ended is a value: `Attempt.outcome` (the `GenerationEnd`, or `Preempted`) or
`Attempt.failed` (`Failed`, `Lost`), a setback for `pdserve.gateway.decisions.decide`.

`attach` attaches to a resumable request another gateway left on a decode: a decode step with
no prefill (`follow_decode` serves both). Every step reaches the instances through `Peers`.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import cast

import structlog
from opentelemetry import trace
from opentelemetry.context import Context

from pdserve.common import telemetry
from pdserve.common.errors import ErrorReason, PdserveError, is_taken_over
from pdserve.gateway.active_request import ActiveRequest
from pdserve.gateway.cleanups import Cleanups
from pdserve.gateway.decisions import Failed, Lost, Preempted
from pdserve.gateway.fleet.backend import (
    Backend,
    DecodeCall,
    FinishedEvent,
    FirstTokenEvent,
    HandedOffEvent,
    PreemptionEvent,
    PrefillCall,
)
from pdserve.gateway.fleet.instance import InstanceRole
from pdserve.gateway.relay import AttemptFailed, LossWatch, connection_lost, relay
from pdserve.gateway.request import GenerationEnd, Placement, TokenChunk
from pdserve.gateway.routing.pair import Pair

log = structlog.get_logger("pdserve.gateway.attempt")
_tracer = telemetry.tracer("pdserve.gateway")

PREFILL, DECODE = InstanceRole.PREFILL, InstanceRole.DECODE

Settle = Callable[[Pair, InstanceRole, bool], None]
DecodeEnd = FinishedEvent | PreemptionEvent


@dataclass(frozen=True)
class Peers:
    """How attempts reach the instances; the same for every attempt.

    Attributes:
        backend: Calls to prefill and decode instances.
        loss_watch: Interrupts the streams of instances the registry lost.
        end_grace_s: How long a stream may go on once the gateway saw the completion end.
        settle: Told when an attempt is done with one of its instances (`Router.settle`):
            the prefill once it computed the prompt (or the attempt left it), the decode once
            the attempt ended; with whether the work ran there (the prompt was computed: the
            decode held a lease), rather than being refused or failing before.
        cleanups: Gives back, in the background, what an attempt left held.
    """

    backend: Backend
    loss_watch: LossWatch
    end_grace_s: float
    settle: Settle
    cleanups: Cleanups


@dataclass(eq=False)
class Attempt:
    """One attempt of `active` on `pair`: its steps, and what they left held.

    Attributes:
        active: The request (this attempt counted in its state); the tokens advance its
            progress.
        pair: Where it runs.
        peers: How it reaches the instances.
        span: Its span (first token and preemption become its events).
        owes_abort: The prefill may still hold the request (AbortRequest on leaving).
        lease_id: The decode lease the attempt holds (ReleaseLease on leaving), if any.
        has_run: The prompt was computed (the decode held a lease): the work ran there.
        has_decoded: Its decode step streamed from the decode.
        is_first_token_attempt: It delivered the request's first token.
        handed_off: The prefill's hand-off, once it came.
        finished: The instance's end, once it came.
        preempted: The decode's preemption notice, if one came.
        context: The trace context under its span (its calls become its children).
    """

    active: ActiveRequest
    pair: Pair
    peers: Peers
    span: trace.Span = trace.INVALID_SPAN
    owes_abort: bool = True
    lease_id: str | None = None
    has_run: bool = False
    has_decoded: bool = False
    is_first_token_attempt: bool = False
    handed_off: HandedOffEvent | None = None
    finished: FinishedEvent | None = None
    preempted: PreemptionEvent | None = None
    context: Context = field(init=False)

    def __post_init__(self) -> None:
        self.context = trace.set_span_in_context(self.span)

    @classmethod
    def start(cls, active: ActiveRequest, pair: Pair, peers: Peers) -> Attempt:
        """Counts a new attempt of `active` on `pair` and opens its ``gateway.attempt`` span,
        a child of the request's (the caller ends it)."""
        num_attempts = active.start_attempt()
        span = _tracer.start_span(
            "gateway.attempt",
            context=active.context,
            attributes={
                telemetry.REQUEST_ID: active.request_id,
                "pdserve.attempt": num_attempts,
                "pdserve.prefill.instance_id": pair.prefill.instance_id,
                "pdserve.decode.instance_id": pair.decode.instance_id,
                "pdserve.num_generated_tokens": active.progress.num_tokens,
            },
        )
        return cls(active, pair, peers, span)

    async def begin(self) -> None:
        """Waits for the previous attempt's AbortRequest still on its way (the Prefill call
        reuses the request id, possibly on the same prefill), then logs the start."""
        active, pair = self.active, self.pair
        await self.peers.cleanups.wait_for_abort(active.request_id)
        log.debug(
            "attempt_started",
            request_id=active.request_id,
            attempt=active.state.num_attempts,
            prefill_id=pair.prefill.instance_id,
            decode_id=pair.decode.instance_id,
            num_generated_tokens=active.progress.num_tokens,
        )

    def prefill_call(self) -> PrefillCall:
        """The attempt's Prefill call: the prompt and the tokens delivered so far."""
        active, pair = self.active, self.pair
        request = active.request
        return PrefillCall(
            request_id=request.request_id,
            token_ids=active.progress.continuation_token_ids(),
            num_prompt_tokens=len(request.prompt_token_ids),
            sampling=active.continuation_sampling(),
            decode_address=pair.decode.address,
            decode_instance_id=pair.decode.instance_id,
            trace_context=self.context,
            share_key=request.share_key,
        )

    async def prefill(self) -> AsyncGenerator[TokenChunk, None]:
        """Prefill to the hand-off (or the end); yields the first token.

        Raises:
            AttemptFailed: The prefill stream failed or ended without its terminal event.
        """
        active, pair, peers = self.active, self.pair, self.peers
        timeline = active.timeline
        call = self.prefill_call()
        timeline.on_prefill_call()
        prefill = peers.backend.prefill(pair.prefill.address, call, active.remaining_s())
        # NOTE: until the hand-off, the attempt waits on the decode too (allocation, KV).
        watched = {pair.prefill.instance_id: PREFILL, pair.decode.instance_id: DECODE}
        try:
            try:
                relayed = relay(
                    PREFILL, prefill, active.progress, peers.loss_watch, watched, peers.end_grace_s
                )
                async with aclosing(relayed) as events:
                    async for event in events:
                        if isinstance(event, TokenChunk):
                            index = {"pdserve.completion_index": event.first_index}
                            self.span.add_event("first_token", index)
                            yield event
                        elif isinstance(event, FirstTokenEvent):
                            self.has_run = True  # computed, with a lease: off the prefill's queue
                            peers.settle(pair, PREFILL, True)
                            self.is_first_token_attempt = timeline.on_first_token(event.phases)
                        elif isinstance(event, HandedOffEvent):
                            self._on_handed_off(event)
                        elif isinstance(event, FinishedEvent):
                            self.finished = event
                            break
            finally:
                peers.settle(pair, PREFILL, self.has_run)
            if self.finished is None and self.handed_off is None:
                raise connection_lost(PREFILL, "the prefill stream ended without a terminal event")
        except AttemptFailed as failed:
            # NOTE: a prefill that reported the failure itself has already ended the request
            # and released its lease. An AbortRequest now would arrive late and could cancel
            # the retry, which reuses the request id on the same prefill.
            self.owes_abort = not failed.failure.is_from_server
            raise
        self.owes_abort = False

    def _on_handed_off(self, event: HandedOffEvent) -> None:
        self.handed_off, self.lease_id = event, event.lease_id
        active = self.active
        if active.resumable is not None:
            target = self.pair.decode
            placement = Placement(target.instance_id, target.address, event.lease_id)
            active.resumable.on_placed(placement)
        if self.is_first_token_attempt:
            active.timeline.on_handed_off(event.phases)

    def decode(self) -> AsyncGenerator[TokenChunk, None]:
        """Generate on the decode from the hand-off to its end or a preemption notice: the
        relayed stream itself, so each token reaches the orchestrator through no layer here
        (`outcome` checks that the stream ended with its terminal event)."""
        handed_off, progress = self.handed_off, self.active.progress
        if handed_off is None or progress.finish_reason is not None:
            return _no_chunks()
        target = self.pair.decode
        placement = Placement(target.instance_id, target.address, handed_off.lease_id)
        self.has_decoded = True
        return follow_decode(self.active, self.peers, placement, self.context, self._ended)

    def _ended(self, event: DecodeEnd) -> None:
        self.lease_id = None  # the decode let go of it
        if isinstance(event, FinishedEvent):
            self.finished = event
            return
        self.preempted = event
        self.span.add_event(
            "preemption",
            {"pdserve.reason": str(event.reason),
             "pdserve.num_generated_tokens": event.num_generated_tokens},
        )  # fmt: skip

    def outcome(self) -> GenerationEnd | Preempted:
        """How an attempt whose steps both ran ended: preempted before the completion's end,
        or the end.

        Raises:
            AttemptFailed: The decode stream ended without its terminal event.
        """
        preempted, active = self.preempted, self.active
        if (
            self.has_decoded
            and self.finished is None
            and preempted is None
            and active.progress.finish_reason is None
        ):
            raise connection_lost(DECODE, "the decode stream ended without a terminal event")
        if preempted is not None and active.progress.finish_reason is None:
            message = f"preempted ({preempted.reason}) after {preempted.num_generated_tokens}"
            error = PdserveError(ErrorReason.PREEMPTED, f"{message} tokens")
            return Preempted(self.pair, error)
        # NOTE: the gateway may see the end (stop id, max_tokens) before an instance does: a
        # lease handed off in the meantime is released by `release`.
        return active.end(self.finished)

    def failed(self, failed: AttemptFailed) -> Failed | Lost:
        """How an attempt whose step raised `failed` ended."""
        if is_taken_over(failed.failure.error):
            self.lease_id = None  # NOTE: another gateway's stream holds the lease now
        return failed.setback(self.pair, self.active.progress.num_tokens)

    def release(self) -> None:
        """The attempt is over: settles its decode, and gives back what it still holds: the
        prefill request, the lease (kept for a resumable request its gateway left)."""
        active, pair, peers = self.active, self.pair, self.peers
        peers.settle(pair, DECODE, self.has_run)
        if self.owes_abort:
            peers.cleanups.abort(pair.prefill.address, active.request_id, self.context)
        if self.lease_id is not None and not active.is_left:
            address = pair.decode.address
            peers.cleanups.release(address, self.lease_id, active.request_id, self.context)


def follow_decode(
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
    call = DecodeCall(
        active.request_id,
        placement.lease_id,
        context,
        resumable=active.resumable is not None,
        resume=resume,
    )
    decode = peers.backend.generate(placement.decode_address, call, active.remaining_s())
    watched = {placement.decode_instance_id: DECODE}
    relayed = relay(
        DECODE, decode, active.progress, peers.loss_watch, watched, peers.end_grace_s, on_end
    )
    # NOTE: with `on_end`, a decode's relayed stream yields only `TokenChunk`s.
    return cast(AsyncGenerator[TokenChunk, None], relayed)


async def _no_chunks() -> AsyncGenerator[TokenChunk, None]:
    return
    yield  # NOTE: makes this an (empty) async generator


async def attach(
    active: ActiveRequest, peers: Peers
) -> AsyncGenerator[TokenChunk | GenerationEnd | None, None]:
    """Attaches to a resumable request another gateway left on a decode
    (``active.resumable.attach_to``).

    The decode replays every completion token so far, then the live ones and the end.

    Args:
        active: The request (re-prepared: the same prompt and seed); the replay fills its
            progress.
        peers: How to reach the decode.

    Yields:
        `TokenChunk`s new to the consumer, then the `GenerationEnd`, or None when the
        request must go on through a prefill from its progress (the decode preempted it,
        forgot it, or cannot be reached).
    """
    assert active.resumable is not None and active.resumable.attach_to is not None
    placement, progress = active.resumable.attach_to, active.progress
    lease_id: str | None = placement.lease_id
    finished: FinishedEvent | None = None

    def ended(event: DecodeEnd) -> None:
        nonlocal lease_id, finished
        lease_id = None  # the decode let go of it
        if isinstance(event, FinishedEvent):
            finished = event

    fields = {"request_id": active.request_id, "decode_id": placement.decode_instance_id}
    try:
        try:
            following = follow_decode(active, peers, placement, active.context, ended, resume=True)
            async with aclosing(following) as chunks:
                async for chunk in chunks:
                    yield chunk
        except AttemptFailed as failed:
            lease_id = None  # NOTE: gone, forgotten or unreachable: nothing to give back
            if is_taken_over(failed.failure.error):
                raise failed.failure.error from failed  # NOTE: another gateway holds it now
            log.info("resume_attach_failed", **fields, reason=failed.failure.error.reason.name)
        if finished is not None or progress.finish_reason is not None:
            yield active.end(finished)
            return
        num_tokens = progress.num_tokens
        log.info("resume_continues_elsewhere", **fields, num_generated_tokens=num_tokens)
        yield None
    finally:
        if lease_id is not None and not active.is_left:
            address = placement.decode_address
            peers.cleanups.release(address, lease_id, active.request_id, active.context)
