"""One attempt of a request on a prefill/decode pair, ending in an outcome value.

An attempt is: ``Prefill`` on a prefill P (targeting decode D) -> ``FirstToken`` (delivered at
once) -> ``HandedOff{lease}`` -> ``DecodeService.Generate(lease)`` on D -> token batches ->
``Finished``. `Attempts.run` yields the tokens new to the consumer, then exactly one outcome:
the `GenerationEnd`, or a setback (`Preempted`, `Failed`, `Lost`) for
`pdserve.gateway.decisions.decide`.

Leaving an attempt early (a setback, the consumer closing the stream, a client disconnect)
aborts the prefill request and releases the decode lease (`pdserve.gateway.cleanups`).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import replace

import structlog
from opentelemetry import trace

from pdserve.common.errors import ErrorReason, PdserveError, is_taken_over
from pdserve.common.generation import FinishReason
from pdserve.gateway.attempt_legs import AttemptLegs
from pdserve.gateway.cleanups import Cleanups
from pdserve.gateway.decisions import Preempted, RetryPolicy, Setback
from pdserve.gateway.fleet.backend import (
    Backend,
    DecodeEvent,
    FinishedEvent,
    PreemptionEvent,
    PrefillCall,
    PrefillEvent,
)
from pdserve.gateway.fleet.instance import InstanceRole
from pdserve.gateway.phases import TtftTimeline
from pdserve.gateway.progress import CompletionProgress, RequestState
from pdserve.gateway.relay import AttemptFailed, LossWatch, relay
from pdserve.gateway.request import (
    GenerationEnd,
    GenerationRequest,
    Placement,
    Resumable,
    TokenChunk,
    remaining_s,
)
from pdserve.gateway.routing.pair import Pair

log = structlog.get_logger("pdserve.gateway.attempt")

PREFILL, DECODE = InstanceRole.PREFILL, InstanceRole.DECODE


class Attempts:
    """Runs attempts over a `Backend`, and gives back what an attempt left behind.

    Args:
        backend: Calls to prefill and decode instances.
        loss_watch: Interrupts the streams of instances the registry lost.
        policy: Cleanup deadline and end grace.
        settle: Told when an attempt is done with one of its instances (`Router.settle`):
            the prefill once it computed the prompt (or the attempt left it), the decode once
            the attempt ended; with whether the work ran there (the prompt was computed: the
            decode held a lease), rather than being refused or failing before.
    """

    def __init__(
        self,
        backend: Backend,
        loss_watch: LossWatch,
        policy: RetryPolicy,
        settle: Callable[[Pair, InstanceRole, bool], None] = lambda pair, role, has_run: None,
    ) -> None:
        self._backend = backend
        self._loss_watch = loss_watch
        self._policy = policy
        self._settle = settle
        self.cleanups = Cleanups(backend, policy.cleanup_timeout_s)

    async def wait_for_cleanups(self) -> None:
        """Waits until every background AbortRequest / ReleaseLease has finished."""
        await self.cleanups.wait()

    async def run(
        self,
        request: GenerationRequest,
        pair: Pair,
        progress: CompletionProgress,
        state: RequestState,
        deadline: float,
        span: trace.Span,
        timeline: TtftTimeline | None = None,
        resumable: Resumable | None = None,
    ) -> AsyncGenerator[TokenChunk | GenerationEnd | Setback, None]:
        """One attempt on `pair`.

        Args:
            request: The request.
            pair: Where to run it.
            progress: The tokens delivered so far (the attempt continues from there).
            state: The request's bookkeeping (this attempt counted).
            deadline: ``loop.time()`` by which the request must be done.
            span: The attempt's span (first token and preemption become its events).
            timeline: Where the request's time to first token went (this attempt's Prefill
                call, and its phases if it delivers the first token).
            resumable: Set for a resumable request: its decode stream is resumable, and the
                decode that takes it is announced.

        Yields:
            `TokenChunk`s new to the consumer, then one `GenerationEnd` or setback.

        Raises:
            PdserveError: DEADLINE_EXCEEDED before a call could start.
        """
        context = trace.set_span_in_context(span)
        await self.cleanups.wait_for_abort(request.request_id)
        call = PrefillCall(
            request_id=request.request_id,
            token_ids=progress.continuation_token_ids(),
            num_prompt_tokens=len(request.prompt_token_ids),
            # NOTE: the prompt's logprobs went out with the first token: a continuation does
            # not score the prompt again (and may reuse the prefix cache).
            sampling=(
                replace(request.sampling, prompt_logprobs=None)
                if progress.num_tokens
                else request.sampling
            ),
            decode_address=pair.decode.address,
            decode_instance_id=pair.decode.instance_id,
            trace_context=context,
            share_key=request.share_key,
        )
        log.debug(
            "attempt_started",
            request_id=request.request_id,
            attempt=state.num_attempts,
            prefill_id=pair.prefill.instance_id,
            decode_id=pair.decode.instance_id,
            num_generated_tokens=progress.num_tokens,
        )
        legs = AttemptLegs(
            request,
            pair,
            progress,
            deadline,
            span,
            context,
            timeline or TtftTimeline(),
            resumable,
        )
        outcome: GenerationEnd | Setback
        try:
            try:
                async with aclosing(
                    legs.prefill_leg(self._backend, call, self._relay, self._settle)
                ) as chunks:
                    async for chunk in chunks:
                        yield chunk
            except AttemptFailed as failed:
                # NOTE: a prefill that reported the failure itself has already ended the
                # request and released its lease. An AbortRequest now would arrive late and
                # could cancel the retry, which reuses the request id on the same prefill.
                legs.owes_abort = not failed.failure.is_from_server
                raise
            async with aclosing(legs.decode_leg(self._backend, self._relay)) as chunks:
                async for chunk in chunks:
                    yield chunk
            preempted = legs.preempted
            if preempted is not None and progress.finish_reason is None:
                message = f"preempted ({preempted.reason}) after {preempted.num_generated_tokens}"
                error = PdserveError(ErrorReason.PREEMPTED, f"{message} tokens")
                outcome = Preempted(pair, error)
            else:
                # NOTE: the gateway may see the end (stop id, max_tokens) before an instance
                # does: a lease handed off in the meantime is released below.
                outcome = _end(progress, state, legs.finished)
        except AttemptFailed as failed:
            if is_taken_over(failed.failure.error):
                legs.lease_id = None  # NOTE: another gateway's stream holds the lease now
            outcome = failed.setback(pair, progress.num_tokens)
        finally:
            self._settle(pair, DECODE, legs.has_run)
            legs.clean_up(self.cleanups)
        yield outcome

    async def attach(
        self,
        request: GenerationRequest,
        resumable: Resumable,
        placement: Placement,
        progress: CompletionProgress,
        state: RequestState,
        deadline: float,
        span: trace.Span,
    ) -> AsyncGenerator[TokenChunk | GenerationEnd | None, None]:
        """Attaches to a resumable request another gateway left on a decode.

        The decode replays every completion token so far, then the live ones and the end.

        Args:
            request: The request (re-prepared: the same prompt and seed).
            resumable: The request's resumability (left: the lease is kept on leaving).
            placement: The decode and lease it runs on.
            progress: The tokens delivered so far (the replay fills it).
            state: The request's bookkeeping.
            deadline: ``loop.time()`` by which the request must be done.
            span: The request's span.

        Yields:
            `TokenChunk`s new to the consumer, then the `GenerationEnd`, or None when the
            request must go on through a prefill from `progress` (the decode preempted it,
            forgot it, or cannot be reached).
        """
        context = trace.set_span_in_context(span)
        lease_id: str | None = placement.lease_id
        finished: FinishedEvent | None = None
        preempted: PreemptionEvent | None = None
        fields = {"request_id": request.request_id, "decode_id": placement.decode_instance_id}
        try:
            decode = self._backend.generate(
                placement.decode_address,
                request.request_id,
                placement.lease_id,
                remaining_s(request, deadline),
                context,
                resumable=True,
                resume=True,
            )
            watched = {placement.decode_instance_id: DECODE}
            try:
                async with aclosing(self._relay(DECODE, decode, progress, watched)) as events:
                    async for event in events:
                        if isinstance(event, TokenChunk):
                            yield event
                        elif isinstance(event, FinishedEvent):
                            finished, lease_id = event, None
                            break
                        elif isinstance(event, PreemptionEvent):
                            preempted, lease_id = event, None
                            break
            except AttemptFailed as failed:
                lease_id = None  # NOTE: gone, forgotten or unreachable: nothing to give back
                if is_taken_over(failed.failure.error):
                    raise failed.failure.error from failed  # NOTE: another gateway holds it now
                log.info("resume_attach_failed", **fields, reason=failed.failure.error.reason.name)
            if preempted is not None:
                accepted = progress.accept(preempted.generated_token_ids, 0)
                if accepted.chunk is not None:
                    yield accepted.chunk
            if finished is not None or progress.finish_reason is not None:
                yield _end(progress, state, finished)
                return
            num_tokens = progress.num_tokens
            log.info("resume_continues_elsewhere", **fields, num_generated_tokens=num_tokens)
            yield None
        finally:
            if lease_id is not None and not resumable.is_left:
                address = placement.decode_address
                self.cleanups.release(address, lease_id, request.request_id, context)

    def _relay(
        self,
        role: InstanceRole,
        stream: AsyncGenerator[PrefillEvent, None] | AsyncGenerator[DecodeEvent, None],
        progress: CompletionProgress,
        watched: dict[str, InstanceRole],
    ) -> AsyncGenerator[TokenChunk | PrefillEvent | DecodeEvent, None]:
        end_grace_s = self._policy.end_grace_s
        return relay(role, stream, progress, self._loss_watch, watched, end_grace_s)


def _end(
    progress: CompletionProgress, state: RequestState, finished: FinishedEvent | None
) -> GenerationEnd:
    """The completion's end: the gateway's own finish reason first, else the instance's."""
    reason = progress.finish_reason
    if reason is None and finished is not None:
        reason = finished.finish_reason
    return GenerationEnd(
        finish_reason=reason or FinishReason.STOP,
        num_completion_tokens=progress.num_tokens,
        num_cached_prompt_tokens=finished.num_cached_prompt_tokens if finished else 0,
        num_attempts=state.num_attempts,
        num_reschedules=state.num_reschedules,
    )
