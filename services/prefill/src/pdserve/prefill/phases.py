"""Where a prefill request's time goes, from its arrival to its handoff.

A `PhaseClock` holds the monotonic times a request reaches each boundary; `durations` turns
them into the phases that the Prefill stream reports (`PrefillPhases` on FirstToken and
HandedOff), that the ``pdserve_prefill_phase_seconds`` histogram counts and that the request's
span carries as ``pdserve.phase.<name>_ms``:

    arrival --lease--> lease granted --queue--> first chunk scheduled --compute--> first token
        --transfer_tail--> handed off

A request that ships no KV takes no lease: its lease phase is 0 and its queue starts at arrival.
The lease phase includes the wait for the request's turn in the lease window
(`leasing.LeaseWindow`) and the AllocateBlocks retries; the queue phase includes the KV-store load
and the wait for the engine's token budget. The compute phase ends when the engine thread
sampled the first token (not when the event loop, perhaps busy sending KV, saw it). The
transfer tail is the part of the KV transfer the computation did not hide: it delays the
decode's first token (the completion's second), not the first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from opentelemetry import trace

from pdserve.prefill.metrics import PrefillMetrics


@dataclass(frozen=True)
class PhaseDurations:
    """A prefill request's phases in seconds (None: not reached).

    Attributes:
        lease_s: Arrival until the decode granted the lease, the wait for its turn included
            (0 when no KV is shipped).
        queue_s: Lease (or arrival) until the engine scheduled the first chunk.
        compute_s: First scheduled chunk until the first token was sampled.
        transfer_tail_s: First token until the decode acknowledged the KV commit.
        transport: The KV transport ("grpc", "tcp", "shm"); "" when none was used.
    """

    lease_s: float | None = None
    queue_s: float | None = None
    compute_s: float | None = None
    transfer_tail_s: float | None = None
    transport: str = ""

    def by_name(self) -> dict[str, float]:
        """The phases reached, by name (``lease``, ``queue``, ``compute``, ``transfer_tail``)."""
        phases = {
            "lease": self.lease_s,
            "queue": self.queue_s,
            "compute": self.compute_s,
            "transfer_tail": self.transfer_tail_s,
        }
        return {name: value for name, value in phases.items() if value is not None}

    def after_first_token(self) -> PhaseDurations:
        """Only what follows the first token (the transfer tail), for a handoff whose earlier
        phases were recorded with the first token."""
        return PhaseDurations(transfer_tail_s=self.transfer_tail_s, transport=self.transport)


@dataclass
class PhaseClock:
    """The times (``time.monotonic()``) one request reached each boundary (None: not yet).

    The event loop sets every field but ``first_scheduled``, which the engine thread sets once
    (a plain float store; the event loop reads it only after the first token, which the engine
    thread sends after setting it).
    """

    arrival: float = field(default_factory=time.monotonic)
    lease_granted: float | None = None
    first_scheduled: float | None = None
    first_token: float | None = None
    handed_off: float | None = None

    def mark_scheduled(self, now: float) -> None:
        """Records the first pass that computes the request (later passes change nothing)."""
        if self.first_scheduled is None:
            self.first_scheduled = now

    def durations(self, transport: str = "") -> PhaseDurations:
        """The phases reached so far; `transport` is reported with a transfer tail only."""
        if self.first_token is None:
            return PhaseDurations()
        queue_start = self.arrival if self.lease_granted is None else self.lease_granted
        compute_start = self.first_token if self.first_scheduled is None else self.first_scheduled
        tail = None if self.handed_off is None else _elapsed(self.first_token, self.handed_off)
        return PhaseDurations(
            lease_s=_elapsed(self.arrival, queue_start),
            queue_s=_elapsed(queue_start, compute_start),
            compute_s=_elapsed(compute_start, self.first_token),
            transfer_tail_s=tail,
            transport=transport if tail is not None else "",
        )


def record(durations: PhaseDurations, span: trace.Span, metrics: PrefillMetrics | None) -> None:
    """Observes the phases in the histogram and sets them on `span` (``pdserve.phase.*_ms``)."""
    for name, seconds in durations.by_name().items():
        if metrics is not None:
            metrics.phase_seconds.labels(phase=name).observe(seconds)
        span.set_attribute(f"pdserve.phase.{name}_ms", round(seconds * 1000, 3))
    if durations.transport:
        span.set_attribute("pdserve.phase.transport", durations.transport)


def _elapsed(start: float, end: float) -> float:
    # NOTE: the engine thread's clock read may trail the event loop's by a hair; never negative.
    return max(0.0, end - start)
