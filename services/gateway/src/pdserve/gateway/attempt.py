"""One attempt of a request on a prefill/decode pair, ending in an outcome value.

An attempt is: ``Prefill`` on a prefill P (targeting decode D) -> ``FirstToken`` (delivered at
once) -> ``HandedOff{lease}`` -> ``DecodeService.Generate(lease)`` on D -> token batches ->
``Finished``. `Attempts.run` yields the tokens new to the consumer, then exactly one outcome:
the `GenerationEnd`, or a setback (`Preempted`, `Failed`, `Lost`) for
`pdserve.gateway.decisions.decide`.

Leaving an attempt early (a setback, the consumer closing the stream, a client disconnect)
aborts the prefill request and releases the decode lease in background tasks, so cleanup also
happens inside a cancelled task.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Coroutine
from contextlib import aclosing
from dataclasses import replace
from typing import Any

import structlog
from opentelemetry import trace

from pdserve.common.errors import ErrorReason, PdserveError, is_taken_over
from pdserve.common.generation import FinishReason
from pdserve.gateway.decisions import Preempted, RetryPolicy, Setback
from pdserve.gateway.fleet.backend import (
    Backend,
    BackendError,
    DecodeEvent,
    FinishedEvent,
    FirstTokenEvent,
    HandedOffEvent,
    PreemptionEvent,
    PrefillCall,
    PrefillEvent,
)
from pdserve.gateway.fleet.instance import InstanceRole
from pdserve.gateway.phases import TtftTimeline
from pdserve.gateway.progress import CompletionProgress, RequestState
from pdserve.gateway.relay import AttemptFailed, LossWatch, connection_lost, relay
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
        self._cleanup_tasks: set[asyncio.Task[None]] = set()
        # NOTE: request id -> its AbortRequest still on the way to a prefill.
        self._aborting: dict[str, asyncio.Task[None]] = {}

    async def wait_for_cleanups(self) -> None:
        """Waits until every background AbortRequest / ReleaseLease has finished."""
        while self._cleanup_tasks:
            await asyncio.gather(*self._cleanup_tasks, return_exceptions=True)

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
        # NOTE: the next attempt reuses the request id, possibly on the same prefill: an
        # AbortRequest of the previous one that arrived after it started would cancel it.
        await self._aborted(request.request_id)
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
        # NOTE: what the attempt holds on the instances, given back if it is left early.
        owes_abort, lease_id = True, None
        outcome: GenerationEnd | Setback
        timeline = timeline or TtftTimeline()
        is_first_token_attempt = False
        has_run = False
        try:
            handed_off: HandedOffEvent | None = None
            finished: FinishedEvent | None = None
            timeline.on_prefill_call()
            prefill = self._backend.prefill(
                pair.prefill.address, call, remaining_s(request, deadline)
            )
            # NOTE: until the hand-off, the attempt waits on the decode too (allocation, KV).
            watched = {pair.prefill.instance_id: PREFILL, pair.decode.instance_id: DECODE}
            try:
                async with aclosing(self._relay(PREFILL, prefill, progress, watched)) as events:
                    async for event in events:
                        if isinstance(event, TokenChunk):
                            index = {"pdserve.completion_index": event.first_index}
                            span.add_event("first_token", index)
                            yield event
                        elif isinstance(event, FirstTokenEvent):
                            has_run = True  # computed, with a lease: off the prefill's queue
                            self._settle(pair, PREFILL, True)
                            is_first_token_attempt = timeline.on_first_token(event.phases)
                        elif isinstance(event, HandedOffEvent):
                            handed_off, lease_id = event, event.lease_id
                            if resumable is not None:
                                target = pair.decode
                                placed = Placement(target.instance_id, target.address, lease_id)
                                resumable.on_placed(placed)
                            if is_first_token_attempt:
                                timeline.on_handed_off(event.phases)
                        elif isinstance(event, FinishedEvent):
                            finished = event
                            break
            except AttemptFailed as failed:
                # NOTE: a prefill that reported the failure itself has already ended the
                # request and released its lease. An AbortRequest now would arrive late and
                # could cancel the retry, which reuses the request id on the same prefill.
                owes_abort = not failed.failure.is_from_server
                raise
            finally:
                self._settle(pair, PREFILL, has_run)
            if finished is None and handed_off is None:
                raise connection_lost(PREFILL, "the prefill stream ended without a terminal event")
            owes_abort = False
            preempted: PreemptionEvent | None = None
            if handed_off is not None and progress.finish_reason is None:
                decode = self._backend.generate(
                    pair.decode.address,
                    request.request_id,
                    handed_off.lease_id,
                    remaining_s(request, deadline),
                    context,
                    resumable=resumable is not None,
                )
                watched = {pair.decode.instance_id: DECODE}
                async with aclosing(self._relay(DECODE, decode, progress, watched)) as events:
                    async for event in events:
                        if isinstance(event, TokenChunk):
                            yield event
                        elif isinstance(event, PreemptionEvent | FinishedEvent):
                            lease_id = None  # the decode let go of it
                            if isinstance(event, FinishedEvent):
                                finished = event
                            else:
                                preempted = event
                            break
                if preempted is not None:
                    span.add_event(
                        "preemption",
                        {"pdserve.reason": str(preempted.reason),
                         "pdserve.num_generated_tokens": preempted.num_generated_tokens},
                    )  # fmt: skip
                    accepted = progress.accept(preempted.generated_token_ids, 0)
                    if accepted.chunk is not None:
                        yield accepted.chunk
                elif finished is None and progress.finish_reason is None:
                    raise connection_lost(
                        DECODE, "the decode stream ended without a terminal event"
                    )
            if preempted is not None and progress.finish_reason is None:
                message = f"preempted ({preempted.reason}) after {preempted.num_generated_tokens}"
                error = PdserveError(ErrorReason.PREEMPTED, f"{message} tokens")
                outcome = Preempted(pair, error)
            else:
                # NOTE: the gateway may see the end (stop id, max_tokens) before an instance
                # does: a lease handed off in the meantime is released below.
                outcome = _end(progress, state, finished)
        except AttemptFailed as failed:
            if is_taken_over(failed.failure.error):
                lease_id = None  # NOTE: another gateway's stream holds the lease now
            outcome = failed.setback(pair, progress.num_tokens)
        finally:
            self._settle(pair, DECODE, has_run)
            timeout_s = self._policy.cleanup_timeout_s
            if owes_abort:
                address = pair.prefill.address
                aborting = self._backend.abort_request(
                    address, request.request_id, timeout_s, context
                )
                task = self._spawn(aborting, "abort_request", request.request_id)
                self._aborting[request.request_id] = task
                task.add_done_callback(lambda _: self._forget_abort(request.request_id, task))
            if lease_id is not None and (resumable is None or not resumable.is_left):
                address = pair.decode.address
                releasing = self._backend.release_lease(
                    address, lease_id, request.request_id, timeout_s, context
                )
                self._spawn(releasing, "release_lease", request.request_id)
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
                releasing = self._backend.release_lease(
                    placement.decode_address,
                    lease_id,
                    request.request_id,
                    self._policy.cleanup_timeout_s,
                    context,
                )
                self._spawn(releasing, "release_lease", request.request_id)

    def _relay(
        self,
        role: InstanceRole,
        stream: AsyncGenerator[PrefillEvent, None] | AsyncGenerator[DecodeEvent, None],
        progress: CompletionProgress,
        watched: dict[str, InstanceRole],
    ) -> AsyncGenerator[TokenChunk | PrefillEvent | DecodeEvent, None]:
        end_grace_s = self._policy.end_grace_s
        return relay(role, stream, progress, self._loss_watch, watched, end_grace_s)

    async def _aborted(self, request_id: str) -> None:
        """Waits (within the cleanup deadline) for the request's AbortRequest in flight."""
        task = self._aborting.get(request_id)
        if task is not None:
            await asyncio.wait([task], timeout=self._policy.cleanup_timeout_s)

    def _forget_abort(self, request_id: str, task: asyncio.Task[None]) -> None:
        if self._aborting.get(request_id) is task:
            del self._aborting[request_id]

    def _spawn(
        self, coro: Coroutine[Any, Any, None], what: str, request_id: str
    ) -> asyncio.Task[None]:
        async def run() -> None:
            try:
                await coro
            except BackendError as failure:
                log.debug("cleanup_failed", request_id=request_id, call=what, error=str(failure))

        task = asyncio.get_running_loop().create_task(run())
        self._cleanup_tasks.add(task)
        task.add_done_callback(self._cleanup_tasks.discard)
        log.debug("cleanup_sent", request_id=request_id, call=what)
        return task


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
