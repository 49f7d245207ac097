"""Where a request's time to first token goes, as the gateway sees it.

A `TtftTimeline` follows one client request. The gateway measures its own phases; the prefill
reports its phases on FirstToken and HandedOff (`PrefillPhases`); what is left of the Prefill
call's round trip is the network (and both sides' RPC handling):

    arrival --admission_queue + gateway_queue--> Prefill call dispatched --network + lease +
        prefill_queue + compute--> FirstToken received --first_token_to_client--> first token
        written

``transfer_tail`` (first token until the decode acknowledged the KV commit) runs in parallel
with ``first_token_to_client``: it delays the second token, not the first. The gateway queue
includes validation, tokenization and routing, and attempts that failed before a first token.
Only the attempt that delivered the request's first token reports prefill phases; an older
prefill that sends none leaves those phases (and ``network``) unrecorded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from opentelemetry import trace
from prometheus_client import Histogram

from pdserve.gateway.fleet.backend import PrefillPhases

# The gateway's phases in the order they happen (transfer_tail overlaps first_token_to_client).
PHASES = (
    "admission_queue",
    "gateway_queue",
    "network",
    "lease",
    "prefill_queue",
    "compute",
    "first_token_to_client",
    "transfer_tail",
)


@dataclass
class TtftTimeline:
    """The times (``time.monotonic()``) one request reached each boundary, and the phases its
    prefill reported (None: not yet, or not reported)."""

    arrival: float = field(default_factory=time.monotonic)
    prefill_dispatched: float | None = None
    first_token_received: float | None = None
    first_token_written: float | None = None
    prefill: PrefillPhases | None = None
    transfer_tail_s: float | None = None
    transport: str = ""
    queue_wait_s: float = 0.0

    @property
    def has_first_token(self) -> bool:
        return self.first_token_received is not None

    def on_queue_wait(self, seconds: float) -> None:
        """The request waited `seconds` in the admission queue (counted before the first
        token only)."""
        if not self.has_first_token:
            self.queue_wait_s += seconds

    def on_prefill_call(self) -> None:
        """A Prefill call is dispatched (the last one before the first token counts)."""
        if not self.has_first_token:
            self.prefill_dispatched = time.monotonic()

    def on_first_token(self, phases: PrefillPhases | None) -> bool:
        """A prefill's FirstToken arrived; True if it is the request's first token (the
        attempt that delivered it then reports its handoff with `on_handed_off`)."""
        if self.has_first_token:
            return False
        self.first_token_received = time.monotonic()
        self.prefill = phases
        return True

    def on_handed_off(self, phases: PrefillPhases | None) -> None:
        """The first token's prefill handed off (its phases carry the transfer tail)."""
        if phases is not None and phases.transfer_tail_s is not None:
            self.transfer_tail_s = phases.transfer_tail_s
            self.transport = phases.transport

    def on_first_token_written(self) -> None:
        """The front end took the first token's delta (for a stream: it was written)."""
        if self.first_token_written is None:
            self.first_token_written = time.monotonic()

    def durations(self) -> dict[str, float]:
        """The phases measured, in seconds, by name (see `PHASES`)."""
        phases: dict[str, float] = {}
        dispatched, received = self.prefill_dispatched, self.first_token_received
        if dispatched is not None:
            phases["admission_queue"] = self.queue_wait_s
            phases["gateway_queue"] = max(
                0.0, _elapsed(self.arrival, dispatched) - self.queue_wait_s
            )
        if self.prefill is not None:
            prefill = self.prefill
            if dispatched is not None and received is not None:
                inside = prefill.lease_s + prefill.queue_s + prefill.compute_s
                phases["network"] = max(0.0, received - dispatched - inside)
            phases["lease"] = prefill.lease_s
            phases["prefill_queue"] = prefill.queue_s
            phases["compute"] = prefill.compute_s
        if received is not None and self.first_token_written is not None:
            phases["first_token_to_client"] = _elapsed(received, self.first_token_written)
        if self.transfer_tail_s is not None:
            phases["transfer_tail"] = self.transfer_tail_s
        return phases

    def record(self, histogram: Histogram, span: trace.Span) -> None:
        """Observes each phase measured (``phase`` label) and sets it on `span` as
        ``pdserve.phase.<name>_ms``."""
        for name, seconds in self.durations().items():
            histogram.labels(phase=name).observe(seconds)
            span.set_attribute(f"pdserve.phase.{name}_ms", round(seconds * 1000, 3))
        if self.transport:
            span.set_attribute("pdserve.phase.transport", self.transport)


def _elapsed(start: float, end: float) -> float:
    return max(0.0, end - start)
