"""The legs of one attempt on a prefill/decode pair, and what it holds on its instances.

`AttemptLegs` runs the prefill leg (``Prefill`` -> ``FirstToken`` -> ``HandedOff``), then the
decode leg (``Generate(lease)`` -> token batches -> ``Finished`` or a preemption notice), and
records on itself what each leaves held (a prefill request to abort, a lease to release), which
`clean_up` gives back when the attempt ends.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context

from pdserve.gateway.cleanups import Cleanups
from pdserve.gateway.fleet.backend import (
    Backend,
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
from pdserve.gateway.progress import CompletionProgress
from pdserve.gateway.relay import connection_lost
from pdserve.gateway.request import (
    GenerationRequest,
    Placement,
    Resumable,
    TokenChunk,
    remaining_s,
)
from pdserve.gateway.routing.pair import Pair

PREFILL, DECODE = InstanceRole.PREFILL, InstanceRole.DECODE

Relay = Callable[
    [
        InstanceRole,
        AsyncGenerator[PrefillEvent, None] | AsyncGenerator[DecodeEvent, None],
        CompletionProgress,
        dict[str, InstanceRole],
    ],
    AsyncGenerator[TokenChunk | PrefillEvent | DecodeEvent, None],
]


@dataclass
class AttemptLegs:
    """One attempt's request, pair and progress, and what its legs left held.

    Attributes:
        owes_abort: The prefill may still hold the request (AbortRequest on leaving).
        lease_id: The decode lease the attempt holds (ReleaseLease on leaving), if any.
        has_run: The prompt was computed (the decode held a lease): the work ran there.
        handed_off: The prefill's hand-off, once it came.
        finished: The instance's end, once it came.
        preempted: The decode's preemption notice, if one came.
    """

    request: GenerationRequest
    pair: Pair
    progress: CompletionProgress
    deadline: float
    span: trace.Span
    context: Context
    timeline: TtftTimeline
    resumable: Resumable | None
    owes_abort: bool = True
    lease_id: str | None = None
    has_run: bool = False
    is_first_token_attempt: bool = False
    handed_off: HandedOffEvent | None = None
    finished: FinishedEvent | None = None
    preempted: PreemptionEvent | None = None

    async def prefill_leg(
        self,
        backend: Backend,
        call: PrefillCall,
        relay: Relay,
        settle: Callable[[Pair, InstanceRole, bool], None],
    ) -> AsyncGenerator[TokenChunk, None]:
        """Prefill to the hand-off (or the end); yields the first token."""
        pair = self.pair
        self.timeline.on_prefill_call()
        prefill = backend.prefill(
            pair.prefill.address, call, remaining_s(self.request, self.deadline)
        )
        # NOTE: until the hand-off, the attempt waits on the decode too (allocation, KV).
        watched = {pair.prefill.instance_id: PREFILL, pair.decode.instance_id: DECODE}
        try:
            async with aclosing(relay(PREFILL, prefill, self.progress, watched)) as events:
                async for event in events:
                    if isinstance(event, TokenChunk):
                        index = {"pdserve.completion_index": event.first_index}
                        self.span.add_event("first_token", index)
                        yield event
                    elif isinstance(event, FirstTokenEvent):
                        self.has_run = True  # computed, with a lease: off the prefill's queue
                        settle(pair, PREFILL, True)
                        self.is_first_token_attempt = self.timeline.on_first_token(event.phases)
                    elif isinstance(event, HandedOffEvent):
                        self._on_handed_off(event)
                    elif isinstance(event, FinishedEvent):
                        self.finished = event
                        break
        finally:
            settle(pair, PREFILL, self.has_run)
        if self.finished is None and self.handed_off is None:
            raise connection_lost(PREFILL, "the prefill stream ended without a terminal event")
        self.owes_abort = False

    def _on_handed_off(self, event: HandedOffEvent) -> None:
        self.handed_off, self.lease_id = event, event.lease_id
        if self.resumable is not None:
            target = self.pair.decode
            self.resumable.on_placed(Placement(target.instance_id, target.address, event.lease_id))
        if self.is_first_token_attempt:
            self.timeline.on_handed_off(event.phases)

    async def decode_leg(self, backend: Backend, relay: Relay) -> AsyncGenerator[TokenChunk, None]:
        """Generate on the decode from the hand-off to its end or a preemption notice."""
        handed_off, progress = self.handed_off, self.progress
        if handed_off is None or progress.finish_reason is not None:
            return
        decode = backend.generate(
            self.pair.decode.address,
            self.request.request_id,
            handed_off.lease_id,
            remaining_s(self.request, self.deadline),
            self.context,
            resumable=self.resumable is not None,
        )
        watched = {self.pair.decode.instance_id: DECODE}
        async with aclosing(relay(DECODE, decode, progress, watched)) as events:
            async for event in events:
                if isinstance(event, TokenChunk):
                    yield event
                elif isinstance(event, PreemptionEvent | FinishedEvent):
                    self.lease_id = None  # the decode let go of it
                    if isinstance(event, FinishedEvent):
                        self.finished = event
                    else:
                        self.preempted = event
                    break
        preempted = self.preempted
        if preempted is not None:
            self.span.add_event(
                "preemption",
                {"pdserve.reason": str(preempted.reason),
                 "pdserve.num_generated_tokens": preempted.num_generated_tokens},
            )  # fmt: skip
            accepted = progress.accept(preempted.generated_token_ids, 0)
            if accepted.chunk is not None:
                yield accepted.chunk
        elif self.finished is None and progress.finish_reason is None:
            raise connection_lost(DECODE, "the decode stream ended without a terminal event")

    def clean_up(self, cleanups: Cleanups) -> None:
        """Gives back what the attempt still holds: the prefill request, the lease (kept for
        a resumable request its gateway left)."""
        request_id = self.request.request_id
        if self.owes_abort:
            cleanups.abort(self.pair.prefill.address, request_id, self.context)
        resumable = self.resumable
        if self.lease_id is not None and (resumable is None or not resumable.is_left):
            cleanups.release(self.pair.decode.address, self.lease_id, request_id, self.context)
