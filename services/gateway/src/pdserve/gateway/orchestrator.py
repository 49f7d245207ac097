"""Runs one client request across prefill and decode, hiding every recoverable failure.

An attempt is: ``Prefill`` on a prefill P (targeting decode D) -> ``FirstToken`` (delivered at
once) -> ``HandedOff{lease}`` -> ``DecodeService.Generate(lease)`` on D -> token batches ->
``Finished``. What can go wrong, and what happens then:

* An error status is classified by its reason's retry scope (never by message text):
  another decode / prefill / pair / instance -> exclude the failed instance and try again;
  whole request / once -> try again; never -> give up. At most ``max_attempts`` failures.
* A ``PreemptionNotice``, or a decode lost mid-stream (connection lost, a stream that ends
  without a terminal event), reschedules the request: prefill prompt + delivered tokens, with
  the same sampling and seed, then decode on (possibly) another instance. At most
  ``preempt_retry_count`` reschedules.
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
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import structlog

from pdserve.common.errors import ErrorReason, PdserveError, RetryScope
from pdserve.gateway.backend import (
    Backend,
    BackendError,
    DecodeEvent,
    FinishedEvent,
    FirstTokenEvent,
    HandedOffEvent,
    PreemptionEvent,
    PrefillCall,
    PrefillEvent,
    TokenBatchEvent,
)
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.progress import CompletionProgress
from pdserve.gateway.registry import Registry
from pdserve.gateway.request import FinishReason, GenerationEnd, GenerationRequest, TokenChunk
from pdserve.gateway.router import Pair, Router

log = structlog.get_logger("pdserve.gateway.orchestrator")

OrchestratorEvent: TypeAlias = TokenChunk | GenerationEnd


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
    """

    max_attempts: int = 3
    preempt_retry_count: int = 4
    preempt_retry_exclude_decode: bool = False
    cleanup_timeout_s: float = 2.0
    end_grace_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.preempt_retry_count < 0:
            raise ValueError(f"preempt_retry_count must be >= 0, got {self.preempt_retry_count}")


class _Reschedule(Exception):
    """Continue the request elsewhere with its delivered tokens."""

    def __init__(self, cause: str, decode_id: str, error: PdserveError) -> None:
        super().__init__(cause)
        self.cause = cause
        self.decode_id = decode_id
        self.error = error


class _AttemptFailed(Exception):
    """An attempt failed with an error status or a transport failure."""

    def __init__(self, stage: str, failure: BackendError) -> None:
        super().__init__(str(failure))
        self.stage = stage
        self.failure = failure


@dataclass
class _RequestState:
    """Bookkeeping of one request across its attempts."""

    progress: CompletionProgress
    excluded_prefill_ids: set[str] = field(default_factory=set)
    excluded_decode_ids: set[str] = field(default_factory=set)
    preempted_decode_ids: set[str] = field(default_factory=set)
    num_attempts: int = 0
    num_failures: int = 0
    num_reschedules: int = 0
    has_used_once_retry: bool = False
    last_error: PdserveError | None = None


def _lost(stage: str, message: str) -> _AttemptFailed:
    error = PdserveError(ErrorReason.PEER_UNAVAILABLE, message)
    return _AttemptFailed(stage, BackendError(error, is_from_server=False))


class Orchestrator:
    """Turns a `GenerationRequest` into one ordered, gap-free stream of tokens.

    Args:
        backend: Calls to prefill and decode instances.
        router: Pair selection.
        registry: Told about instances that stopped answering.
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
        self._registry = registry
        self._policy = policy
        self._metrics = metrics
        self._cleanup_tasks: set[asyncio.Task[None]] = set()

    async def wait_for_cleanups(self) -> None:
        """Waits until every background AbortRequest / ReleaseLease has finished."""
        while self._cleanup_tasks:
            await asyncio.gather(*self._cleanup_tasks, return_exceptions=True)

    async def run(
        self, request: GenerationRequest, deadline: float
    ) -> AsyncGenerator[OrchestratorEvent, None]:
        """Generates the completion.

        Args:
            request: The prepared request (its seed is fixed).
            deadline: ``loop.time()`` by which the request must be done.

        Yields:
            `TokenChunk`s with strictly consecutive indices, then one `GenerationEnd`.

        Raises:
            PdserveError: The error that ended the request (non-retryable, or retries
                exhausted, or DEADLINE_EXCEEDED).
        """
        state = _RequestState(CompletionProgress(request))
        while True:
            pair = self._pick(request, state, deadline)
            state.num_attempts += 1
            try:
                async with contextlib.aclosing(
                    self._attempt(request, pair, state, deadline)
                ) as events:
                    async for event in events:
                        yield event
                return
            except _Reschedule as reschedule:
                self._on_reschedule(request, state, reschedule)
            except _AttemptFailed as failed:
                self._on_failure(request, pair, state, failed, deadline)

    def _remaining_s(self, request: GenerationRequest, deadline: float) -> float:
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            raise PdserveError(
                ErrorReason.DEADLINE_EXCEEDED,
                "the request did not finish within the gateway's request timeout",
                {"requestId": request.request_id},
            )
        return remaining

    def _pick(self, request: GenerationRequest, state: _RequestState, deadline: float) -> Pair:
        self._remaining_s(request, deadline)
        progress = state.progress
        num_tokens = len(request.prompt_token_ids) + progress.num_tokens
        try:
            try:
                return self._router.pick(
                    request.model,
                    num_tokens,
                    progress.num_remaining_tokens,
                    exclude_prefill_ids=state.excluded_prefill_ids,
                    exclude_decode_ids=state.excluded_decode_ids | state.preempted_decode_ids,
                )
            except PdserveError:
                if not state.preempted_decode_ids:
                    raise
                # NOTE: avoiding the preempting decode is a preference, not a requirement.
                return self._router.pick(
                    request.model,
                    num_tokens,
                    progress.num_remaining_tokens,
                    exclude_prefill_ids=state.excluded_prefill_ids,
                    exclude_decode_ids=state.excluded_decode_ids,
                )
        except PdserveError as error:
            # NOTE: when earlier attempts excluded every instance, their error explains more
            # (and carries its retry delay, e.g. DECODE_CAPACITY_EXHAUSTED -> 429).
            if state.last_error is not None:
                raise state.last_error from error
            raise

    async def _attempt(
        self, request: GenerationRequest, pair: Pair, state: _RequestState, deadline: float
    ) -> AsyncGenerator[OrchestratorEvent, None]:
        progress = state.progress
        call = PrefillCall(
            request_id=request.request_id,
            token_ids=progress.continuation_token_ids(),
            num_prompt_tokens=len(request.prompt_token_ids),
            sampling=request.sampling,
            decode_address=pair.decode.address,
            decode_instance_id=pair.decode.instance_id,
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
            async with contextlib.aclosing(
                self._guard("prefill", prefill_stream, progress)
            ) as events:
                async for event in events:
                    if isinstance(event, TokenChunk):
                        yield event
                    elif isinstance(event, HandedOffEvent):
                        handed_off, lease_id = event, event.lease_id
                    elif isinstance(event, FinishedEvent):
                        is_prefill_done = True
                        yield self._end(progress, state, event)
                        return
            if handed_off is None:
                raise _lost("prefill", "the prefill stream ended without a terminal event")
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
            )
            async with contextlib.aclosing(
                self._guard("decode", decode_stream, progress)
            ) as events:
                async for event in events:
                    if isinstance(event, TokenChunk):
                        yield event
                    elif isinstance(event, PreemptionEvent):
                        is_decode_done = True
                        accepted = progress.accept(event.generated_token_ids, 0)
                        if accepted.chunk is not None:
                            yield accepted.chunk
                        if progress.finish_reason is not None:
                            yield self._end(progress, state, None)
                            return
                        raise _Reschedule(
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
            raise _lost("decode", "the decode stream ended without a terminal event")
        finally:
            if not is_prefill_done:
                self._spawn(
                    self._backend.abort_request(
                        pair.prefill.address, request.request_id, self._policy.cleanup_timeout_s
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
                    ),
                    "release_lease",
                    request.request_id,
                )

    async def _guard(
        self,
        stage: str,
        stream: AsyncGenerator[PrefillEvent, None] | AsyncGenerator[DecodeEvent, None],
        progress: CompletionProgress,
    ) -> AsyncGenerator[TokenChunk | PrefillEvent | DecodeEvent, None]:
        """Relays a stream: tokens go through `progress`, errors become `_AttemptFailed`.

        Once the gateway has seen the completion end, it waits at most ``end_grace_s`` for
        the stream's terminal event and ignores further tokens.
        """
        events = stream
        try:
            while True:
                try:
                    if progress.finish_reason is None:
                        event = await anext(events)
                    else:
                        async with asyncio.timeout(self._policy.end_grace_s):
                            event = await anext(events)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    return
                except BackendError as failure:
                    raise _AttemptFailed(stage, failure) from failure
                if isinstance(event, FirstTokenEvent | TokenBatchEvent):
                    if isinstance(event, FirstTokenEvent):
                        accepted = progress.accept((event.token_id,), event.index)
                    else:
                        accepted = progress.accept(event.token_ids, event.first_index)
                    if accepted.chunk is not None:
                        yield accepted.chunk
                    if accepted.has_gap:
                        gap = PdserveError(
                            ErrorReason.INTERNAL, f"{stage} skipped completion indices"
                        )
                        raise _AttemptFailed(stage, BackendError(gap, is_from_server=True))
                else:
                    yield event
        finally:
            with contextlib.suppress(BackendError):
                await events.aclose()

    def _end(
        self, progress: CompletionProgress, state: _RequestState, finished: FinishedEvent | None
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

    def _on_reschedule(
        self, request: GenerationRequest, state: _RequestState, reschedule: _Reschedule
    ) -> None:
        state.num_reschedules += 1
        state.last_error = reschedule.error
        if reschedule.cause == "preempted":
            if self._policy.preempt_retry_exclude_decode:
                state.preempted_decode_ids.add(reschedule.decode_id)
        else:
            state.excluded_decode_ids.add(reschedule.decode_id)
        if state.num_reschedules > self._policy.preempt_retry_count:
            log.warning(
                "reschedules_exhausted",
                request_id=request.request_id,
                cause=reschedule.cause,
                num_reschedules=state.num_reschedules - 1,
            )
            raise reschedule.error
        self._metrics.reschedules.labels(cause=reschedule.cause).inc()
        log.info(
            "request_rescheduled",
            request_id=request.request_id,
            cause=reschedule.cause,
            decode_id=reschedule.decode_id,
            num_generated_tokens=state.progress.num_tokens,
            num_reschedules=state.num_reschedules,
        )

    def _on_failure(
        self,
        request: GenerationRequest,
        pair: Pair,
        state: _RequestState,
        failed: _AttemptFailed,
        deadline: float,
    ) -> None:
        error = failed.failure.error
        self._remaining_s(request, deadline)
        if error.reason is ErrorReason.DEADLINE_EXCEEDED:
            raise error
        if not failed.failure.is_from_server:
            # NOTE: a transport failure: the instance we called is gone (or going).
            called = pair.prefill if failed.stage == "prefill" else pair.decode
            self._registry.mark_unreachable(called.instance_id)
            if failed.stage == "decode":
                self._on_reschedule(
                    request, state, _Reschedule("decode_lost", pair.decode.instance_id, error)
                )
                return
            state.excluded_prefill_ids.add(pair.prefill.instance_id)
        elif error.retry_scope is RetryScope.RESCHEDULE:
            self._on_reschedule(
                request, state, _Reschedule("preempted", pair.decode.instance_id, error)
            )
            return
        elif error.retry_scope in (RetryScope.NEVER, RetryScope.REGISTER_AGAIN):
            raise error
        elif error.retry_scope is RetryScope.ONCE:
            if state.has_used_once_retry:
                raise error
            state.has_used_once_retry = True
        else:
            self._exclude(failed.stage, pair, state, error)
        state.num_failures += 1
        state.last_error = error
        if state.num_failures >= self._policy.max_attempts:
            log.warning(
                "attempts_exhausted",
                request_id=request.request_id,
                reason=error.reason.name,
                num_attempts=state.num_attempts,
            )
            raise error
        self._metrics.retries.labels(reason=error.reason.name).inc()
        log.warning(
            "attempt_failed_retrying",
            request_id=request.request_id,
            stage=failed.stage,
            reason=error.reason.name,
            retry_scope=error.retry_scope.name,
            is_from_server=failed.failure.is_from_server,
            prefill_id=pair.prefill.instance_id,
            decode_id=pair.decode.instance_id,
            attempt=state.num_attempts,
        )

    @staticmethod
    def _exclude(stage: str, pair: Pair, state: _RequestState, error: PdserveError) -> None:
        """Excludes the instance(s) an error with a server-chosen retry scope blames."""
        scope = error.retry_scope
        blamed_id = error.metadata.get("instanceId")
        if scope is RetryScope.ANOTHER_PAIR:
            state.excluded_prefill_ids.add(pair.prefill.instance_id)
            state.excluded_decode_ids.add(pair.decode.instance_id)
        elif scope is RetryScope.ANOTHER_DECODE:
            state.excluded_decode_ids.add(pair.decode.instance_id)
        elif scope is RetryScope.ANOTHER_PREFILL:
            state.excluded_prefill_ids.add(pair.prefill.instance_id)
        elif scope is RetryScope.ANOTHER_INSTANCE:
            if blamed_id == pair.decode.instance_id or stage == "decode":
                state.excluded_decode_ids.add(pair.decode.instance_id)
            elif blamed_id == pair.prefill.instance_id:
                state.excluded_prefill_ids.add(pair.prefill.instance_id)
            elif error.reason is ErrorReason.PEER_UNAVAILABLE:
                # NOTE: a prefill that reports an unreachable peer means its decode target.
                state.excluded_decode_ids.add(pair.decode.instance_id)
            else:
                state.excluded_prefill_ids.add(pair.prefill.instance_id)

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
