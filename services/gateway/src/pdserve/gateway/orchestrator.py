"""Runs one client request across prefill and decode, hiding every recoverable failure.

An attempt is: ``Prefill`` on a prefill P (targeting decode D) -> ``FirstToken`` (delivered at
once) -> ``HandedOff{lease}`` -> ``DecodeService.Generate(lease)`` on D -> token batches ->
``Finished``. What can go wrong, and what happens then:

* An error status is classified by its reason's retry scope (never by message text):
  another decode / prefill / pair / instance -> exclude the failed instance and try again;
  whole request / once -> try again; never -> give up. At most ``max_attempts`` failures.
* A ``PreemptionNotice``, or a decode lost mid-stream (connection lost, a stream that ends
  without a terminal event, a decode that stopped heartbeating: see `pdserve.gateway.relay`),
  reschedules the request: prefill prompt + delivered tokens, with the same sampling and seed,
  then decode on (possibly) another instance. At most ``preempt_retry_count`` reschedules.
* Every attempt after the first token is such a continuation, and `CompletionProgress` drops
  tokens the consumer already has, so the consumer sees each completion index exactly once.
* Leaving an attempt early (an error, the consumer closing the stream, a client disconnect)
  aborts the prefill request and releases the decode lease in background tasks, so cleanup
  also happens inside a cancelled task.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Coroutine
from typing import Any, TypeAlias

import structlog
from opentelemetry import trace

from pdserve.common import telemetry
from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import FinishReason
from pdserve.gateway.backend import (
    Backend,
    BackendError,
    DecodeEvent,
    FinishedEvent,
    HandedOffEvent,
    PreemptionEvent,
    PrefillCall,
    PrefillEvent,
)
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.progress import CompletionProgress
from pdserve.gateway.registry import Registry
from pdserve.gateway.relay import LossWatch, relay
from pdserve.gateway.request import GenerationEnd, GenerationRequest, TokenChunk
from pdserve.gateway.retry import (
    AttemptFailed,
    RequestState,
    Reschedule,
    RetryHandler,
    RetryPolicy,
    connection_lost,
)
from pdserve.gateway.router import Pair, Router

log = structlog.get_logger("pdserve.gateway.orchestrator")
_tracer = telemetry.tracer("pdserve.gateway")

OrchestratorEvent: TypeAlias = TokenChunk | GenerationEnd


class Orchestrator:
    """Turns a `GenerationRequest` into one ordered, gap-free stream of tokens.

    Args:
        backend: Calls to prefill and decode instances.
        router: Pair selection.
        registry: Told about instances that stopped answering; tells about instances that
            stopped heartbeating (their streams are interrupted and the requests move).
        policy: Retry limits.
        metrics: Retry and reschedule counters.
    """

    def __init__(
        self,
        backend: Backend,
        router: Router,
        registry: Registry,
        policy: RetryPolicy,
        metrics: GatewayMetrics,
    ) -> None:
        self._backend = backend
        self._router = router
        self._policy = policy
        self._retries = RetryHandler(policy, registry, metrics)
        self._cleanup_tasks: set[asyncio.Task[None]] = set()
        self.loss_watch = LossWatch()
        registry.add_lost_listener(lambda entry: self.loss_watch.notify(entry.instance_id))

    async def wait_for_cleanups(self) -> None:
        """Waits until every background AbortRequest / ReleaseLease has finished."""
        while self._cleanup_tasks:
            await asyncio.gather(*self._cleanup_tasks, return_exceptions=True)

    async def run(
        self,
        request: GenerationRequest,
        deadline: float,
        parent_span: trace.Span = trace.INVALID_SPAN,
    ) -> AsyncGenerator[OrchestratorEvent, None]:
        """Generates the completion.

        Args:
            request: The prepared request (its seed is fixed).
            deadline: ``loop.time()`` by which the request must be done.
            parent_span: The request's span; routing and each attempt become its children,
                retries and reschedules its events.

        Yields:
            `TokenChunk`s with strictly consecutive indices, then one `GenerationEnd`.

        Raises:
            PdserveError: The error that ended the request (non-retryable, or retries
                exhausted, or DEADLINE_EXCEEDED).
        """
        state = RequestState(CompletionProgress(request))
        parent = trace.set_span_in_context(parent_span)
        while True:
            with _tracer.start_as_current_span(
                "gateway.route",
                context=parent,
                attributes={telemetry.REQUEST_ID: request.request_id},
            ) as route:
                pair = self._pick(request, state, deadline)
                route.set_attribute("pdserve.prefill.instance_id", pair.prefill.instance_id)
                route.set_attribute("pdserve.decode.instance_id", pair.decode.instance_id)
            state.num_attempts += 1
            attempt = _tracer.start_span(
                "gateway.attempt",
                context=parent,
                attributes={
                    telemetry.REQUEST_ID: request.request_id,
                    "pdserve.attempt": state.num_attempts,
                    "pdserve.prefill.instance_id": pair.prefill.instance_id,
                    "pdserve.decode.instance_id": pair.decode.instance_id,
                    "pdserve.num_generated_tokens": state.progress.num_tokens,
                },
            )
            try:
                async with contextlib.aclosing(
                    self._attempt(request, pair, state, deadline, attempt)
                ) as events:
                    async for event in events:
                        yield event
                return
            except Reschedule as reschedule:
                attempt.set_status(trace.Status(trace.StatusCode.ERROR, reschedule.cause))
                self._retries.on_reschedule(request, state, reschedule)
                parent_span.add_event(
                    "retry",
                    {"pdserve.cause": reschedule.cause, "pdserve.reason": "PREEMPTED"
                     if reschedule.cause == "preempted" else "PEER_UNAVAILABLE"},
                )  # fmt: skip
            except AttemptFailed as failed:
                reason = failed.failure.error.reason.name
                attempt.set_status(trace.Status(trace.StatusCode.ERROR, reason))
                self._remaining_s(request, deadline)
                self._retries.on_failure(request, pair, state, failed)
                parent_span.add_event(
                    "retry", {"pdserve.reason": reason, "pdserve.stage": failed.stage}
                )
            finally:
                attempt.end()
            if state.wait_before_retry_s:
                remaining = self._remaining_s(request, deadline)
                await asyncio.sleep(min(state.wait_before_retry_s, remaining))
                state.wait_before_retry_s = 0.0

    def _remaining_s(self, request: GenerationRequest, deadline: float) -> float:
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            raise PdserveError(
                ErrorReason.DEADLINE_EXCEEDED,
                "the request did not finish within the gateway's request timeout",
                {"requestId": request.request_id},
            )
        return remaining

    def _pick(self, request: GenerationRequest, state: RequestState, deadline: float) -> Pair:
        self._remaining_s(request, deadline)
        progress = state.progress
        num_tokens = len(request.prompt_token_ids) + progress.num_tokens

        def pick(excluded: tuple[set[str], set[str]]) -> Pair:
            return self._router.pick(
                request.model,
                num_tokens,
                progress.num_remaining_tokens,
                exclude_prefill_ids=excluded[0],
                exclude_decode_ids=excluded[1],
            )

        *preferred, required = state.exclusions()
        for excluded in preferred:
            with contextlib.suppress(PdserveError):
                return pick(excluded)
        try:
            return pick(required)
        except PdserveError as error:
            # NOTE: when earlier attempts excluded every instance, their error explains more
            # (and carries its retry delay, e.g. DECODE_CAPACITY_EXHAUSTED -> 429).
            if state.last_error is not None:
                raise state.last_error from error
            raise

    async def _attempt(
        self,
        request: GenerationRequest,
        pair: Pair,
        state: RequestState,
        deadline: float,
        span: trace.Span,
    ) -> AsyncGenerator[OrchestratorEvent, None]:
        progress = state.progress
        attempt_context = trace.set_span_in_context(span)
        call = PrefillCall(
            request_id=request.request_id,
            token_ids=progress.continuation_token_ids(),
            num_prompt_tokens=len(request.prompt_token_ids),
            sampling=request.sampling,
            decode_address=pair.decode.address,
            decode_instance_id=pair.decode.instance_id,
            trace_context=attempt_context,
        )
        log.debug(
            "attempt_started",
            request_id=request.request_id,
            attempt=state.num_attempts,
            prefill_id=pair.prefill.instance_id,
            decode_id=pair.decode.instance_id,
            num_generated_tokens=progress.num_tokens,
        )
        is_prefill_done = False
        lease_id: str | None = None
        is_decode_done = False
        try:
            prefill_stream = self._backend.prefill(
                pair.prefill.address, call, self._remaining_s(request, deadline)
            )
            handed_off: HandedOffEvent | None = None
            # NOTE: until the hand-off, the attempt waits on the decode too (allocation, KV).
            watched = {pair.prefill.instance_id: "prefill", pair.decode.instance_id: "decode"}
            try:
                async with contextlib.aclosing(
                    self._relay("prefill", prefill_stream, progress, watched)
                ) as events:
                    async for event in events:
                        if isinstance(event, TokenChunk):
                            span.add_event(
                                "first_token", {"pdserve.completion_index": event.first_index}
                            )
                            yield event
                        elif isinstance(event, HandedOffEvent):
                            handed_off, lease_id = event, event.lease_id
                        elif isinstance(event, FinishedEvent):
                            is_prefill_done = True
                            yield self._end(progress, state, event)
                            return
            except AttemptFailed as failed:
                # NOTE: a prefill that reported the failure itself has already ended the
                # request and released its lease. An AbortRequest now would arrive late and
                # could cancel the retry, which reuses the request id on the same prefill.
                is_prefill_done = failed.failure.is_from_server
                raise
            if handed_off is None:
                raise connection_lost(
                    "prefill", "the prefill stream ended without a terminal event"
                )
            is_prefill_done = True
            if progress.finish_reason is not None:
                # NOTE: the gateway saw the end (stop id, max_tokens) but prefill handed off:
                # the lease is released in `finally`.
                yield self._end(progress, state, None)
                return

            decode_stream = self._backend.generate(
                pair.decode.address,
                request.request_id,
                handed_off.lease_id,
                self._remaining_s(request, deadline),
                attempt_context,
            )
            async with contextlib.aclosing(
                self._relay("decode", decode_stream, progress, {pair.decode.instance_id: "decode"})
            ) as events:
                async for event in events:
                    if isinstance(event, TokenChunk):
                        yield event
                    elif isinstance(event, PreemptionEvent):
                        is_decode_done = True
                        span.add_event(
                            "preemption",
                            {"pdserve.reason": str(event.reason),
                             "pdserve.num_generated_tokens": event.num_generated_tokens},
                        )  # fmt: skip
                        accepted = progress.accept(event.generated_token_ids, 0)
                        if accepted.chunk is not None:
                            yield accepted.chunk
                        if progress.finish_reason is not None:
                            yield self._end(progress, state, None)
                            return
                        raise Reschedule(
                            "preempted",
                            pair.decode.instance_id,
                            PdserveError(
                                ErrorReason.PREEMPTED,
                                f"preempted ({event.reason}) after "
                                f"{event.num_generated_tokens} tokens",
                            ),
                        )
                    elif isinstance(event, FinishedEvent):
                        is_decode_done = True
                        yield self._end(progress, state, event)
                        return
            if progress.finish_reason is not None:
                yield self._end(progress, state, None)
                return
            raise connection_lost("decode", "the decode stream ended without a terminal event")
        finally:
            if not is_prefill_done:
                self._spawn(
                    self._backend.abort_request(
                        pair.prefill.address,
                        request.request_id,
                        self._policy.cleanup_timeout_s,
                        attempt_context,
                    ),
                    "abort_request",
                    request.request_id,
                )
            if lease_id is not None and not is_decode_done:
                self._spawn(
                    self._backend.release_lease(
                        pair.decode.address,
                        lease_id,
                        request.request_id,
                        self._policy.cleanup_timeout_s,
                        attempt_context,
                    ),
                    "release_lease",
                    request.request_id,
                )

    def _relay(
        self,
        stage: str,
        stream: AsyncGenerator[PrefillEvent, None] | AsyncGenerator[DecodeEvent, None],
        progress: CompletionProgress,
        watched: dict[str, str],
    ) -> AsyncGenerator[TokenChunk | PrefillEvent | DecodeEvent, None]:
        return relay(stage, stream, progress, self.loss_watch, watched, self._policy.end_grace_s)

    def _end(
        self, progress: CompletionProgress, state: RequestState, finished: FinishedEvent | None
    ) -> GenerationEnd:
        reason = progress.finish_reason
        if reason is None:
            reason = finished.finish_reason if finished and finished.finish_reason else None
        return GenerationEnd(
            finish_reason=reason or FinishReason.STOP,
            num_completion_tokens=progress.num_tokens,
            num_cached_prompt_tokens=finished.num_cached_prompt_tokens if finished else 0,
            num_attempts=state.num_attempts,
            num_reschedules=state.num_reschedules,
        )

    def _spawn(self, coro: Coroutine[Any, Any, None], what: str, request_id: str) -> None:
        async def run() -> None:
            try:
                await coro
            except BackendError as failure:
                log.debug("cleanup_failed", request_id=request_id, call=what, error=str(failure))

        task = asyncio.get_running_loop().create_task(run())
        self._cleanup_tasks.add(task)
        task.add_done_callback(self._cleanup_tasks.discard)
        log.debug("cleanup_sent", request_id=request_id, call=what)
