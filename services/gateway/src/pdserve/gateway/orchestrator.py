"""Runs one client request across prefill and decode, hiding every recoverable failure.

The request loop: route a pair through the admission queue (`pdserve.gateway.routing.queue`:
at once when one has room, else in order of arrival once one has), run an attempt's steps
(`pdserve.gateway.attempt.Attempt`: prefill, decode, release), hand each step's stream of
tokens to the consumer (`CompletionProgress` keeps each completion index exactly once across
attempts), and when the attempt ends in a setback (its outcome, a value), carry out what
`pdserve.gateway.decisions.decide` returns: route again under new exclusions, wait for room
(the instance that had none marked full), reschedule (prefill prompt + delivered tokens with
the same sampling and seed, then decode on), or end the request with its error. After a
setback, a request that finds no pair alive waits for one to come back
(`pdserve.gateway.peer_wait`).

`Orchestrator.parts` hands out the steps' streams themselves, so a token reaches the consumer
through no level of the orchestrator: the consumer drains each stream and asks for the next
part with `next_part`, telling the orchestrator of a stream that failed (`AttemptFailed`),
which moves the request on. `Orchestrator.run` is the same as one flat stream of chunks.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TypeAlias

import structlog
from opentelemetry import trace

from pdserve.common.errors import PdserveError
from pdserve.gateway.active_request import ActiveRequest
from pdserve.gateway.attempt import Attempt, Peers, attach
from pdserve.gateway.cleanups import Cleanups
from pdserve.gateway.decisions import (
    GiveUp,
    Preempted,
    Reschedule,
    RetryPolicy,
    Setback,
    WaitForCapacity,
    decide,
    draining_id,
    unreachable_id,
)
from pdserve.gateway.fleet.backend import Backend
from pdserve.gateway.fleet.instance import InstanceRole
from pdserve.gateway.fleet.registry import Registry
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.pair_choice import PairChoice
from pdserve.gateway.peer_wait import PeerWait
from pdserve.gateway.relay import AttemptFailed, LossWatch
from pdserve.gateway.request import GenerationEnd, TokenChunk
from pdserve.gateway.routing.pair import Pair
from pdserve.gateway.routing.prompt_keys import PromptKeys
from pdserve.gateway.routing.queue import CapacityQueue
from pdserve.gateway.routing.queue_bounds import QueueLimits
from pdserve.gateway.routing.router import Router

log = structlog.get_logger("pdserve.gateway.orchestrator")

OrchestratorEvent: TypeAlias = TokenChunk | GenerationEnd
Part: TypeAlias = AsyncIterator[TokenChunk] | GenerationEnd
"""One of `Orchestrator.parts`: a step's stream of tokens, or the end."""


async def next_part(parts: AsyncGenerator[Part, None], failure: AttemptFailed | None) -> Part:
    """The part after the stream the consumer drained; a stream that failed with `failure` is
    told to the orchestrator instead, which moves the request on.

    Raises:
        PdserveError: The error that ended the request.
    """
    if failure is None:
        return await anext(parts)
    return await parts.athrow(failure)


class _Attached:
    """The chunks of a resumable request's attach (`pdserve.gateway.attempt.attach`); the
    end, if it came, kept aside."""

    def __init__(self, items: AsyncGenerator[TokenChunk | GenerationEnd | None, None]) -> None:
        self._items = items
        self.end: GenerationEnd | None = None

    async def chunks(self) -> AsyncGenerator[TokenChunk, None]:
        async with contextlib.aclosing(self._items) as items:
            async for item in items:
                if item is None:
                    return  # NOTE: it goes on through a prefill
                if isinstance(item, GenerationEnd):
                    self.end = item
                    return
                yield item


class Orchestrator:
    """Turns an `ActiveRequest` into one ordered, gap-free stream of tokens.

    Args:
        backend: Calls to prefill and decode instances.
        router: Pair selection.
        registry: Told about instances that stopped answering; tells about instances that
            stopped heartbeating (their streams are interrupted and the requests move).
        policy: Retry limits.
        metrics: Retry and reschedule counters.
        queue_limits: Bounds of the admission queue.
    """

    def __init__(
        self,
        backend: Backend,
        router: Router,
        registry: Registry,
        policy: RetryPolicy,
        metrics: GatewayMetrics,
        queue_limits: QueueLimits | None = None,
    ) -> None:
        self._router = router
        self._pairs = PairChoice(router, metrics)
        self._registry = registry
        self._policy = policy
        self._metrics = metrics
        self.loss_watch = LossWatch()
        registry.add_lost_listener(lambda entry: self.loss_watch.notify(entry.instance_id))
        self.queue = CapacityQueue(
            queue_limits or QueueLimits(),
            metrics,
            lambda pair, role: router.settle(pair, role, has_run=False),
        )
        # NOTE: room may appear with a load report, an instance joining, or work ending.
        registry.add_load_listener(lambda entry: self.queue.kick())
        registry.add_listener(lambda entry: self.queue.kick())
        cleanups = Cleanups(backend, policy.cleanup_timeout_s)
        self._peers = Peers(backend, self.loss_watch, policy.end_grace_s, self._settle, cleanups)
        self.peer_wait = PeerWait(registry, metrics, policy.peer_wait_s)

    def _settle(self, pair: Pair, role: InstanceRole, has_run: bool) -> None:
        self._router.settle(pair, role, has_run=has_run)
        self.queue.kick()

    async def wait_for_cleanups(self) -> None:
        """Waits until every background AbortRequest / ReleaseLease has finished."""
        await self._peers.cleanups.wait()

    async def run(self, active: ActiveRequest) -> AsyncGenerator[OrchestratorEvent, None]:
        """`parts` as one stream: `TokenChunk`s with strictly consecutive indices, then one
        `GenerationEnd`. Errors as `parts`."""
        parts = self.parts(active)
        async with contextlib.aclosing(parts):
            failure: AttemptFailed | None = None
            while not isinstance(part := await next_part(parts, failure), GenerationEnd):
                failure = None
                try:
                    async for chunk in part:
                        yield chunk
                except AttemptFailed as failed:
                    failure = failed
            yield part

    async def parts(self, active: ActiveRequest) -> AsyncGenerator[Part, None]:
        """Generates the completion of `active`, advancing its progress and state.

        Args:
            active: The request. Its span is the parent of routing and each attempt, and gets
                the retries and reschedules as events; its timeline is filled with where the
                time to first token went; a resumable one with ``attach_to`` first attaches
                to where another gateway left it.

        Yields:
            Each step's stream of `TokenChunk`s (strictly consecutive indices across them),
            for the consumer to drain before it asks for the next part (`next_part`, which
            tells a stream's `AttemptFailed` back here), then one `GenerationEnd`.

        Raises:
            PdserveError: The error that ended the request (non-retryable, or retries
                exhausted, or DEADLINE_EXCEEDED).
        """
        arrival = self.queue.arrival()
        resumable = active.resumable
        if resumable is not None and resumable.attach_to is not None:
            attached = _Attached(attach(active, self._peers))
            async with contextlib.aclosing(attached.chunks()) as chunks:
                yield chunks
            if attached.end is not None:
                yield attached.end
                return
        while True:
            pair = await self._admit(active, arrival)
            attempt = Attempt.start(active, pair, self._peers)
            try:
                await attempt.begin()
                outcome: GenerationEnd | Setback
                try:
                    for step in (attempt.prefill, attempt.decode):
                        async with contextlib.aclosing(step()) as chunks:
                            yield chunks  # NOTE: drained by the consumer; a failure comes back
                    outcome = attempt.outcome()
                except AttemptFailed as failed:
                    outcome = attempt.failed(failed)
                finally:
                    attempt.release()
                if isinstance(outcome, GenerationEnd):
                    yield outcome
                    return  # the attempt ended the completion
                cause = "preempted" if isinstance(outcome, Preempted) else outcome.error.reason.name
                attempt.span.set_status(trace.Status(trace.StatusCode.ERROR, cause))
            finally:
                attempt.span.end()
            self._carry_out(active, outcome)

    async def _admit(self, active: ActiveRequest, arrival: int) -> Pair:
        """The next attempt's pair, once one has room (a request without tokens yet waits in
        order of arrival, within the queue's bounds)."""
        is_new = active.is_new
        # NOTE: the block keys once per attempt: hashing a long prompt costs more than a
        # decision, and a waiting request may be tried many times.
        keys = PromptKeys(active.progress.continuation_token_ids())
        peer_waited_s = 0.0
        while True:
            try:
                pair, waited_s = await self.queue.admit(
                    model=active.request.model,
                    seq=arrival,
                    num_tokens=len(active.progress.continuation_token_ids()),
                    route=functools.partial(self._pairs.route, active, keys),
                    timeout_s=active.remaining_s(),
                    bounded=is_new,
                    # NOTE: before the first token, all waits count against the bound.
                    waited_s=active.queued_s if is_new else 0.0,
                )
                break
            except PdserveError as error:
                # NOTE: no pair alive after a setback: wait for one to come back (each change
                # of the fleet routes again) rather than fail a stream capacity may soon take.
                if not self.peer_wait.applies(active, error):
                    raise
                peer_waited_s += await self.peer_wait.wait(active, error, peer_waited_s)
        if peer_waited_s:
            self.peer_wait.came_back(active, peer_waited_s)
        if waited_s:
            active.on_queue_wait(waited_s)
            active.span.set_attribute("pdserve.queue_wait_ms", round(active.queued_s * 1000, 3))
        return pair

    def _carry_out(self, active: ActiveRequest, setback: Setback) -> None:
        """Decides what follows `setback` and does it; sets the request's next state."""
        active.remaining_s()
        state, progress = active.state, active.progress
        unreachable = unreachable_id(setback)
        if unreachable is not None:
            self._registry.mark_unreachable(unreachable)
        draining = draining_id(setback)
        if draining is not None:
            self._registry.mark_draining(draining)
        decision = decide(setback, state, self._policy)
        error, pair = setback.error, setback.pair
        fields: dict[str, object] = {"request_id": active.request_id, "reason": error.reason.name}
        if isinstance(decision, GiveUp):
            if decision.limit is not None:
                log.warning(
                    "retries_exhausted",
                    **fields,
                    limit=decision.limit.value,
                    num_attempts=state.num_attempts,
                    num_reschedules=state.num_reschedules,
                )
            raise decision.error
        fields |= {
            "decode_id": pair.decode.instance_id,
            "num_generated_tokens": progress.num_tokens,
        }
        if isinstance(decision, Reschedule):
            self._metrics.reschedules.labels(cause=decision.cause.value).inc()
            cause, num_reschedules = decision.cause.value, decision.state.num_reschedules
            log.info("request_rescheduled", **fields, cause=cause, num_reschedules=num_reschedules)
        elif isinstance(decision, WaitForCapacity):
            self._metrics.retries.labels(reason=error.reason.name).inc()
            self._router.loads.mark_full(decision.instance_id)
            log.info("waiting_for_room", **fields, full_id=decision.instance_id)
        else:
            self._metrics.retries.labels(reason=error.reason.name).inc()
            log.warning(
                "attempt_failed_retrying",
                **fields,
                retry_scope=error.retry_scope.name,
                prefill_id=pair.prefill.instance_id,
                attempt=state.num_attempts,
            )
        if isinstance(setback, Preempted):
            attributes = {"pdserve.cause": "preempted", "pdserve.reason": "PREEMPTED"}
        else:
            attributes = {"pdserve.reason": error.reason.name, "pdserve.stage": setback.role.value}
        active.span.add_event("retry", attributes)
        active.state = decision.state
