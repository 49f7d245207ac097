"""One attempt of a request on a prefill/decode pair, ending in an outcome value.

An attempt is: ``Prefill`` on a prefill P (targeting decode D) -> ``FirstToken`` (delivered at
once) -> ``HandedOff{lease}`` -> ``DecodeService.Generate(lease)`` on D -> token batches ->
``Finished``. `Attempts.run` runs its legs (`pdserve.gateway.attempt_legs`) and yields the
tokens new to the consumer, then exactly one outcome: the `GenerationEnd`, or a setback
(`Preempted`, `Failed`, `Lost`) for `pdserve.gateway.decisions.decide`.

Leaving an attempt early (a setback, the consumer closing the stream, a client disconnect)
aborts the prefill request and releases the decode lease (`pdserve.gateway.cleanups`).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing

import structlog
from opentelemetry import trace

from pdserve.common.errors import ErrorReason, PdserveError, is_taken_over
from pdserve.gateway.active_request import ActiveRequest
from pdserve.gateway.attempt_legs import (
    DECODE,
    Attempt,
    DecodeEnd,
    Peers,
    Settle,
    clean_up,
    decode_leg,
    follow_decode,
    prefill_leg,
)
from pdserve.gateway.cleanups import Cleanups
from pdserve.gateway.decisions import Preempted, RetryPolicy, Setback
from pdserve.gateway.fleet.backend import Backend, FinishedEvent
from pdserve.gateway.relay import AttemptFailed, LossWatch
from pdserve.gateway.request import GenerationEnd, TokenChunk
from pdserve.gateway.routing.pair import Pair

log = structlog.get_logger("pdserve.gateway.attempt")


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
        settle: Settle = lambda pair, role, has_run: None,
    ) -> None:
        self._peers = Peers(backend, loss_watch, policy.end_grace_s, settle)
        self.cleanups = Cleanups(backend, policy.cleanup_timeout_s)

    async def wait_for_cleanups(self) -> None:
        """Waits until every background AbortRequest / ReleaseLease has finished."""
        await self.cleanups.wait()

    async def run(
        self, active: ActiveRequest, pair: Pair, span: trace.Span
    ) -> AsyncGenerator[TokenChunk | GenerationEnd | Setback, None]:
        """One attempt on `pair`, continuing from the tokens `active` delivered so far.

        Args:
            active: The request (this attempt counted in its state).
            pair: Where to run it.
            span: The attempt's span (first token and preemption become its events).

        Yields:
            `TokenChunk`s new to the consumer, then one `GenerationEnd` or setback.

        Raises:
            PdserveError: DEADLINE_EXCEEDED before a call could start.
        """
        await self.cleanups.wait_for_abort(active.request_id)
        attempt = Attempt(pair, span)
        log.debug(
            "attempt_started",
            request_id=active.request_id,
            attempt=active.state.num_attempts,
            prefill_id=pair.prefill.instance_id,
            decode_id=pair.decode.instance_id,
            num_generated_tokens=active.progress.num_tokens,
        )
        outcome: GenerationEnd | Setback
        try:
            for leg in (prefill_leg, decode_leg):
                async with aclosing(leg(active, attempt, self._peers)) as chunks:
                    async for chunk in chunks:
                        yield chunk
            outcome = _outcome(active, attempt)
        except AttemptFailed as failed:
            if is_taken_over(failed.failure.error):
                attempt.lease_id = None  # NOTE: another gateway's stream holds the lease now
            outcome = failed.setback(pair, active.progress.num_tokens)
        finally:
            self._peers.settle(pair, DECODE, attempt.has_run)
            clean_up(active, attempt, self.cleanups)
        yield outcome

    async def attach(
        self, active: ActiveRequest
    ) -> AsyncGenerator[TokenChunk | GenerationEnd | None, None]:
        """Attaches to a resumable request another gateway left on a decode
        (``active.resumable.attach_to``).

        The decode replays every completion token so far, then the live ones and the end.

        Args:
            active: The request (re-prepared: the same prompt and seed); the replay fills its
                progress.

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
                async with aclosing(
                    follow_decode(
                        active, self._peers, placement, active.context, ended, resume=True
                    )
                ) as chunks:
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
                self.cleanups.release(address, lease_id, active.request_id, active.context)


def _outcome(active: ActiveRequest, attempt: Attempt) -> GenerationEnd | Preempted:
    """How an attempt whose legs both ran ended: preempted before the completion's end, or
    the end."""
    preempted = attempt.preempted
    if preempted is not None and active.progress.finish_reason is None:
        message = f"preempted ({preempted.reason}) after {preempted.num_generated_tokens}"
        error = PdserveError(ErrorReason.PREEMPTED, f"{message} tokens")
        return Preempted(attempt.pair, error)
    # NOTE: the gateway may see the end (stop id, max_tokens) before an instance does: a lease
    # handed off in the meantime is released by the clean-up.
    return active.end(attempt.finished)
