"""The admission queue: requests that no pair has room for now wait, in order of arrival per
model, until one has.

A request routes through `CapacityQueue.admit` before every attempt. When nobody of its model
waits, it routes at once (the router picks only a decode whose estimated admissible blocks hold
the request's lease, and no instance marked full); when no pair has room, or others of its
model already wait, it joins the queue behind those that arrived before it. Only the head of a
model's queue is tried: a large request is not overtaken forever by small ones.

A request already in the queue whose pair vanished altogether (every prefill or decode of the
model restarting) waits on for one to come back, within the same bounds; a new request that
finds no pair alive and nobody waiting fails at once with NO_HEALTHY_INSTANCES.

The queue is tried again when room may have appeared, never on a timer: a load report, an
instance joining, work this gateway sent to an instance ending (`Router.settle`), or a head
leaving. Routing books the work at once, so the next head sees what is left.

A request that never received a token is bounded by the queue's limits (`QueueLimits`): past
``max_queued_requests`` or ``max_queued_tokens`` it is refused at once, past
``max_queue_wait_s`` in the queue it is refused then, each with DECODE_CAPACITY_EXHAUSTED
(HTTP 429, gRPC RESOURCE_EXHAUSTED) naming the limit in its ``limit`` metadata and a retry
delay from the queue's drain rate. A request already streaming (rescheduled after a
preemption) waits until its deadline instead, ahead of later arrivals. A request whose
consumer goes away leaves the queue at once; work routed for it meanwhile is settled.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.gateway.fleet.instance import InstanceRole
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.routing.pair import Pair
from pdserve.gateway.routing.queue_bounds import (
    MAX_QUEUE_WAIT_S,
    MAX_QUEUED_REQUESTS,
    MAX_QUEUED_TOKENS,
    DrainRate,
    NoPairAlive,
    QueueLimits,
    is_wait,
)

log = structlog.get_logger("pdserve.gateway.routing.queue")


@dataclass
class _Waiter:
    """One request in the queue; `future` gets its routed pair (or the error to raise)."""

    seq: int
    model: str
    num_tokens: int
    route: Callable[[], Pair]
    future: asyncio.Future[Pair]
    enqueued_at: float = field(default_factory=time.monotonic)

    def __lt__(self, other: _Waiter) -> bool:
        return self.seq < other.seq


class CapacityQueue:
    """Per-model FIFO queues of requests waiting for room, tried when room may have appeared.

    Args:
        limits: The queue's bounds.
        metrics: Depth, queued tokens, time in queue and refusals by bound.
        settle: Gives back work routed for a request that left before it could use it
            (`Router.settle`, which ran nothing).
        clock: Monotonic seconds (for the drain rate).
    """

    def __init__(
        self,
        limits: QueueLimits,
        metrics: GatewayMetrics,
        settle: Callable[[Pair, InstanceRole], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        self._metrics = metrics
        self._settle = settle
        self._arrivals = itertools.count()
        self._queues: dict[str, list[_Waiter]] = {}
        self._num_waiting = 0
        self._num_tokens = 0
        self._drained = DrainRate(clock)
        self._is_drain_scheduled = False
        self._is_draining = False

    @property
    def num_waiting(self) -> int:
        """Requests in the queue now."""
        return self._num_waiting

    @property
    def num_waiting_tokens(self) -> int:
        """Prompt tokens of the requests in the queue now."""
        return self._num_tokens

    def arrival(self) -> int:
        """A request's place in the order of arrival (kept across its attempts)."""
        return next(self._arrivals)

    def kick(self) -> None:
        """Room may have appeared: the queue is tried on the next turn of the event loop
        (once, however many kicks came before it)."""
        if self._num_waiting and not (self._is_drain_scheduled or self._is_draining):
            self._is_drain_scheduled = True
            asyncio.get_running_loop().call_soon(self._drain)

    async def admit(
        self,
        *,
        model: str,
        seq: int,
        num_tokens: int,
        route: Callable[[], Pair],
        timeout_s: float,
        bounded: bool,
        waited_s: float = 0.0,
    ) -> tuple[Pair, float]:
        """Routes the request now, or once it is its turn and a pair has room.

        Args:
            model: The served model (one queue each).
            seq: The request's `arrival` ticket.
            num_tokens: The prompt tokens it brings (for the token bound).
            route: Picks and books a pair; raises a wait reason (`is_wait`) when none has
                room, any other error to end the request.
            timeout_s: Seconds left to the request's deadline.
            bounded: Whether the queue's bounds apply (a request that has not yet received
                a token); otherwise only `timeout_s` bounds the wait.
            waited_s: What the request already spent in the queue before (its earlier waits
                count against ``max_queue_wait_s`` too).

        Returns:
            The pair, and the seconds spent in the queue.

        Raises:
            PdserveError: `route`'s error; DECODE_CAPACITY_EXHAUSTED naming a bound (its
                ``limit`` metadata) with a retry delay; DEADLINE_EXCEEDED past `timeout_s`.
        """
        queue = self._queues.get(model)
        if not queue or queue[0].seq > seq:
            # NOTE: nobody of this model arrived before it and waits: try at once.
            try:
                return route(), 0.0
            except PdserveError as error:
                if not is_wait(error):
                    raise
        if bounded:
            self._check_room(num_tokens)
        waiter = _Waiter(
            seq,
            model,
            num_tokens,
            route,
            asyncio.get_running_loop().create_future(),
        )
        self._enter(waiter)
        bound_s = self.limits.max_queue_wait_s - waited_s
        wait_s = min(timeout_s, bound_s) if bounded else timeout_s
        try:
            await asyncio.wait((waiter.future,), timeout=max(0.0, wait_s))
        finally:
            self._leave(waiter)
            if not waiter.future.done():
                waiter.future.cancel()
            elif (
                not waiter.future.cancelled()
                and waiter.future.exception() is None
                and _is_cancelling()
            ):
                # NOTE: routed, but the consumer went away before it could use the pair.
                pair = waiter.future.result()
                self._settle(pair, InstanceRole.PREFILL)
                self._settle(pair, InstanceRole.DECODE)
        waited_s = time.monotonic() - waiter.enqueued_at
        self._metrics.queue_wait.observe(waited_s)
        if waiter.future.cancelled():
            if bounded and bound_s < timeout_s:
                raise self._refusal(
                    MAX_QUEUE_WAIT_S,
                    f"waited {self.limits.max_queue_wait_s:g} s for a decode with room "
                    f"(max_queue_wait_s)",
                )
            raise PdserveError(
                ErrorReason.DEADLINE_EXCEEDED,
                "the request timed out waiting for a decode with room",
            )
        return waiter.future.result(), waited_s

    def retry_after_s(self) -> float:
        """Seconds until the queue has likely drained what waits now (`DrainRate`)."""
        return self._drained.retry_after_s(self._num_waiting, self.limits.max_queue_wait_s)

    # ---- inside ----------------------------------------------------------------------------

    def _check_room(self, num_tokens: int) -> None:
        limits = self.limits
        if self._num_waiting >= limits.max_queued_requests:
            raise self._refusal(
                MAX_QUEUED_REQUESTS,
                f"{self._num_waiting} requests already wait for a decode with room "
                f"(max_queued_requests {limits.max_queued_requests})",
            )
        if self._num_tokens + num_tokens > limits.max_queued_tokens:
            raise self._refusal(
                MAX_QUEUED_TOKENS,
                f"{self._num_tokens} prompt tokens already wait for a decode with room; "
                f"{num_tokens} more pass max_queued_tokens {limits.max_queued_tokens}",
            )

    def _refusal(self, bound: str, message: str) -> PdserveError:
        self._metrics.queue_refusals.labels(bound=bound).inc()
        retry_s = self.retry_after_s()
        log.info("queue_refused", bound=bound, num_waiting=self._num_waiting, retry_s=retry_s)
        return PdserveError(
            ErrorReason.DECODE_CAPACITY_EXHAUSTED,
            message + "; retry later",
            {"limit": bound},
            retry_delay_s=retry_s,
        )

    def _enter(self, waiter: _Waiter) -> None:
        queue = self._queues.setdefault(waiter.model, [])
        bisect.insort(queue, waiter)
        self._num_waiting += 1
        self._num_tokens += waiter.num_tokens
        # NOTE: no kick: a waiter that is the head now had `route` tried just before (the
        # fast path of `admit`), so only a later event can give it room.
        self._publish()

    def _leave(self, waiter: _Waiter) -> None:
        queue = self._queues.get(waiter.model)
        if queue is None:
            return
        at = bisect.bisect_left(queue, waiter)
        if at < len(queue) and queue[at] is waiter:
            del queue[at]
            self._num_waiting -= 1
            self._num_tokens -= waiter.num_tokens
            if not queue:
                del self._queues[waiter.model]
            elif at == 0:
                self.kick()  # NOTE: a new head, which may fit where the old one did not
            self._publish()

    def _drain(self) -> None:
        """Routes the head of each model's queue while it gets a pair."""
        self._is_drain_scheduled = False
        self._is_draining = True
        try:
            self._drain_queues()
        finally:
            self._is_draining = False
            self._publish()

    def _drain_queues(self) -> None:
        for model in list(self._queues):
            queue = self._queues.get(model, [])
            while queue:
                head = queue[0]
                if head.future.done():
                    self._leave(head)
                    continue
                try:
                    pair = head.route()
                except PdserveError as error:
                    # NOTE: no pair alive at all (instances restarting): a request that already
                    # waits goes on waiting for one to come back, within its bounds.
                    if is_wait(error) or isinstance(error, NoPairAlive):
                        break
                    head.future.set_exception(error)
                else:
                    head.future.set_result(pair)
                    self._drained.record()
                self._leave(head)
                queue = self._queues.get(model, [])

    def _publish(self) -> None:
        self._metrics.queued_requests.set(self._num_waiting)
        self._metrics.queued_tokens.set(self._num_tokens)


def _is_cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
