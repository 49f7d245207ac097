"""Waiting for capacity that is coming back: a request that lost its instances waits for a pair
to register again instead of failing at once.

A request that already had a setback (its decode died mid-stream, its prefill went away) and
then finds no prefill/decode pair alive at all does not fail while one may be seconds away (a
launcher or Kubernetes restarting the instance, a partition healing). It waits, as a new
request waits in the admission queue for room, until the registry reports an instance joining
or answering again, then routes anew; up to ``peer_wait_s`` (`RetryPolicy`) and never past
its deadline. The wait is a ``gateway.peer_wait`` span under the request, the
``pdserve_gateway_peer_waits_total{outcome}`` counter and the
``pdserve_gateway_peer_wait_seconds`` histogram; when no pair comes back the client gets the
setback's own reason (PEER_UNAVAILABLE for a lost instance) with a message that says what was
lost, what was tried and for how long.

A request that has had no setback is not held here: with nothing alive it fails at once with
NO_HEALTHY_INSTANCES (HTTP 503 and a retry delay), which is what a client that has received
nothing yet can act on.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from pdserve.common import telemetry
from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.gateway.active_request import ActiveRequest
from pdserve.gateway.fleet.registry import Registry
from pdserve.gateway.metrics import GatewayMetrics

log = structlog.get_logger("pdserve.gateway.peer_wait")
_tracer = telemetry.tracer("pdserve.gateway")


class PeerWait:
    """Holds requests with no live pair until the fleet changes, within their bounds.

    Args:
        registry: Its join and load listeners wake the waiting requests.
        metrics: Waits by outcome, their length and how many wait now.
        wait_s: The most a request waits for a pair (`RetryPolicy.peer_wait_s`; 0: never).
    """

    def __init__(self, registry: Registry, metrics: GatewayMetrics, wait_s: float) -> None:
        self._metrics = metrics
        self.wait_s = wait_s
        self._changed = asyncio.Event()
        # NOTE: an instance registering (again), or one heard from again after a failed call
        # (its heartbeat clears the unreachable mark), may make a pair.
        registry.add_listener(lambda entry: self._wake())
        registry.add_load_listener(lambda entry: self._wake())

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def applies(self, active: ActiveRequest, error: PdserveError) -> bool:
        """Whether `active`, which failed to route with `error`, waits for a pair here: it
        had a setback and no pair is alive (NO_HEALTHY_INSTANCES). With waiting off
        (``peer_wait_s`` 0) `wait` fails it at once, with the setback's own error."""
        return (
            error.reason is ErrorReason.NO_HEALTHY_INSTANCES and active.state.last_error is not None
        )

    async def wait(self, active: ActiveRequest, error: PdserveError, waited_s: float) -> float:
        """Waits until the fleet changes (then the caller routes again).

        Args:
            active: The request (its deadline and its last setback).
            error: The routing error (NO_HEALTHY_INSTANCES).
            waited_s: What this request already waited for a pair since its setback.

        Returns:
            The seconds waited this time.

        Raises:
            PdserveError: ``peer_wait_s`` (or the deadline) passed with no pair back: the
                setback's reason, with a message for a person.
        """
        bound_s = min(self.wait_s - waited_s, active.deadline - asyncio.get_running_loop().time())
        if bound_s <= 0:
            raise self._gave_up(active, waited_s)
        changed = self._changed
        started = time.monotonic()
        self._metrics.peer_waiting.inc()
        with _tracer.start_as_current_span(
            "gateway.peer_wait",
            context=active.context,
            attributes={
                telemetry.REQUEST_ID: active.request_id,
                "pdserve.reason": error.reason.name,
            },
        ) as span:
            if not waited_s:
                log.info(
                    "waiting_for_peer",
                    request_id=active.request_id,
                    num_generated_tokens=active.progress.num_tokens,
                    max_wait_s=round(bound_s, 3),
                )
            try:
                async with asyncio.timeout(bound_s):
                    await changed.wait()
            except TimeoutError:
                pass
            finally:
                self._metrics.peer_waiting.dec()
            spent_s = time.monotonic() - started
            span.set_attribute("pdserve.peer_wait_ms", round(spent_s * 1000, 3))
        self._metrics.peer_wait.observe(spent_s)
        if not changed.is_set():
            raise self._gave_up(active, waited_s + spent_s)
        return spent_s

    def came_back(self, active: ActiveRequest, waited_s: float) -> None:
        """A request that waited `waited_s` for a pair was routed again."""
        self._metrics.peer_waits.labels(outcome="came_back").inc()
        log.info("peer_came_back", request_id=active.request_id, waited_s=round(waited_s, 3))
        active.span.add_event("peer_came_back", {"pdserve.peer_wait_ms": round(waited_s * 1000, 3)})

    def _gave_up(self, active: ActiveRequest, waited_s: float) -> PdserveError:
        self._metrics.peer_waits.labels(outcome="timed_out").inc()
        last = active.state.last_error
        assert last is not None
        state = active.state
        tried = f"{state.num_attempts} attempt{'s' if state.num_attempts != 1 else ''}"
        if state.num_reschedules:
            tried += f", {state.num_reschedules} rescheduled"
        message = (
            f"{last.message}; no prefill/decode pair of model {active.request.model!r} was "
            f"alive to continue it within {waited_s:.3g} s ({tried})"
        )
        log.warning(
            "peer_wait_timed_out",
            request_id=active.request_id,
            waited_s=round(waited_s, 3),
            num_generated_tokens=active.progress.num_tokens,
        )
        metadata = {**last.metadata, "peerWaitSeconds": f"{waited_s:.3g}"}
        return PdserveError(last.reason, message, metadata, retry_delay_s=last.retry_delay_s)
