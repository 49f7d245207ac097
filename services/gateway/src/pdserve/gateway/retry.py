"""Retry decisions of the orchestrator: what a failed or preempted attempt leads to.

Errors are classified by their reason's retry scope, never by message text. A failure the
server reported itself excludes the instance(s) its scope blames (another decode / prefill /
pair / instance), or retries as is (whole request, once), or ends the request (never). A lost
connection to a decode, and a preemption, reschedule the request instead: they count against
``preempt_retry_count``, everything else against ``max_attempts`` (except a full decode after
the first token: the request waits for room until its timeout).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog

from pdserve.common.errors import ErrorReason, PdserveError, RetryScope
from pdserve.gateway.backend import BackendError
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.progress import CompletionProgress
from pdserve.gateway.registry import Registry
from pdserve.gateway.request import GenerationRequest
from pdserve.gateway.router import Pair

log = structlog.get_logger("pdserve.gateway.retry")

DEFAULT_CAPACITY_WAIT_S = 0.2


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


class Reschedule(Exception):
    """Continue the request elsewhere with its delivered tokens (cause: preempted, decode_lost)."""

    def __init__(self, cause: str, decode_id: str, error: PdserveError) -> None:
        super().__init__(cause)
        self.cause = cause
        self.decode_id = decode_id
        self.error = error


class AttemptFailed(Exception):
    """An attempt failed with an error status or a transport failure."""

    def __init__(self, stage: str, failure: BackendError) -> None:
        super().__init__(str(failure))
        self.stage = stage
        self.failure = failure


@dataclass
class RequestState:
    """Bookkeeping of one request across its attempts."""

    progress: CompletionProgress
    excluded_prefill_ids: set[str] = field(default_factory=set)
    excluded_decode_ids: set[str] = field(default_factory=set)
    # NOTE: avoided instances are a preference (used when another one is available), excluded
    # ones a requirement.
    avoided_prefill_ids: set[str] = field(default_factory=set)
    avoided_decode_ids: set[str] = field(default_factory=set)
    num_attempts: int = 0
    num_failures: int = 0
    num_reschedules: int = 0
    has_used_once_retry: bool = False
    last_error: PdserveError | None = None
    wait_before_retry_s: float = 0.0

    def exclusions(self) -> list[tuple[set[str], set[str]]]:
        """(prefill ids, decode ids) to exclude from routing, strictest first.

        The excluded instances are always left out; the avoided ones first together, then
        only the avoided decodes, then only the avoided prefills, then none of them.
        """
        no_ids: set[str] = set()
        avoided = [
            (self.avoided_prefill_ids, self.avoided_decode_ids),
            (no_ids, self.avoided_decode_ids),
            (self.avoided_prefill_ids, no_ids),
            (no_ids, no_ids),
        ]
        result: list[tuple[set[str], set[str]]] = []
        for prefill_ids, decode_ids in avoided:
            pair = (self.excluded_prefill_ids | prefill_ids, self.excluded_decode_ids | decode_ids)
            if pair not in result:
                result.append(pair)
        return result


def connection_lost(stage: str, message: str) -> AttemptFailed:
    """An `AttemptFailed` for a stream that ended without its terminal event."""
    error = PdserveError(ErrorReason.PEER_UNAVAILABLE, message)
    return AttemptFailed(stage, BackendError(error, is_from_server=False))


class RetryHandler:
    """Applies a `RetryPolicy` to failed and preempted attempts.

    Args:
        policy: The limits.
        registry: Told about instances whose connection was lost.
        metrics: Retry and reschedule counters.
    """

    def __init__(self, policy: RetryPolicy, registry: Registry, metrics: GatewayMetrics) -> None:
        self.policy = policy
        self._registry = registry
        self._metrics = metrics

    def on_reschedule(
        self, request: GenerationRequest, state: RequestState, reschedule: Reschedule
    ) -> None:
        """Counts a reschedule; raises its error once ``preempt_retry_count`` is used up."""
        state.num_reschedules += 1
        state.last_error = reschedule.error
        if reschedule.cause == "preempted":
            if self.policy.preempt_retry_exclude_decode:
                state.avoided_decode_ids.add(reschedule.decode_id)
        else:
            state.excluded_decode_ids.add(reschedule.decode_id)
        if state.num_reschedules > self.policy.preempt_retry_count:
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

    def on_failure(
        self,
        request: GenerationRequest,
        pair: Pair,
        state: RequestState,
        failed: AttemptFailed,
    ) -> None:
        """Decides what a failed attempt leads to.

        Returns normally when the request should be tried again (with the exclusions and
        counters updated in `state`); raises the error that ends the request otherwise.

        Raises:
            PdserveError: A non-retryable error, or the last one once retries are exhausted.
        """
        error = failed.failure.error
        if error.reason is ErrorReason.DEADLINE_EXCEEDED:
            raise error
        if not failed.failure.is_from_server:
            # NOTE: a transport failure: the instance we called is gone (or going).
            called = pair.prefill if failed.stage == "prefill" else pair.decode
            self._registry.mark_unreachable(called.instance_id)
            if failed.stage == "decode":
                self.on_reschedule(
                    request, state, Reschedule("decode_lost", pair.decode.instance_id, error)
                )
                return
            state.excluded_prefill_ids.add(pair.prefill.instance_id)
        elif error.retry_scope is RetryScope.RESCHEDULE:
            self.on_reschedule(
                request, state, Reschedule("preempted", pair.decode.instance_id, error)
            )
            return
        elif error.retry_scope in (RetryScope.NEVER, RetryScope.REGISTER_AGAIN):
            raise error
        elif error.reason is ErrorReason.DECODE_CAPACITY_EXHAUSTED and state.progress.num_tokens:
            # NOTE: a completion the client already receives must not fail because decodes are
            # momentarily full (e.g. after a preemption): wait the suggested delay and try
            # again, bounded by the request timeout rather than by max_attempts.
            state.wait_before_retry_s = error.retry_delay_s or DEFAULT_CAPACITY_WAIT_S
            state.last_error = error
            self._metrics.retries.labels(reason=error.reason.name).inc()
            log.info(
                "waiting_for_decode_capacity",
                request_id=request.request_id,
                decode_id=pair.decode.instance_id,
                wait_s=state.wait_before_retry_s,
                num_generated_tokens=state.progress.num_tokens,
            )
            return
        elif error.retry_scope is RetryScope.ONCE:
            if state.has_used_once_retry:
                raise error
            state.has_used_once_retry = True
        else:
            self._exclude(failed.stage, pair, state, error)
            if error.reason is ErrorReason.CACHE_SYNC_FAILED:
                # NOTE: KV that failed its checksum may come from either end (memory, NIC):
                # the retry prefers another prefill and decode when there are any.
                state.avoided_prefill_ids.add(pair.prefill.instance_id)
                state.avoided_decode_ids.add(pair.decode.instance_id)
        state.num_failures += 1
        state.last_error = error
        if state.num_failures >= self.policy.max_attempts:
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
    def _exclude(stage: str, pair: Pair, state: RequestState, error: PdserveError) -> None:
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
            is_decode_blamed = error.metadata.get("decodeAddress") == pair.decode.address
            if blamed_id == pair.decode.instance_id or stage == "decode" or is_decode_blamed:
                state.excluded_decode_ids.add(pair.decode.instance_id)
            elif blamed_id == pair.prefill.instance_id:
                state.excluded_prefill_ids.add(pair.prefill.instance_id)
            elif error.reason is ErrorReason.PEER_UNAVAILABLE:
                # NOTE: a prefill that reports an unreachable peer means its decode target.
                state.excluded_decode_ids.add(pair.decode.instance_id)
            else:
                state.excluded_prefill_ids.add(pair.prefill.instance_id)
