"""One request while the gateway runs it: the prepared request and everything that follows it
across its attempts, in one object.

`ActiveRequest` is made once per request (by the streamer) and handed down as one reference:
the orchestrator, the pair choice and each attempt (`Attempt`, which holds it) read and
advance the same object. It holds the `GenerationRequest`, its `CompletionProgress` (the
tokens delivered), its `RequestState` (attempts, exclusions, reschedules), its deadline, its
`TtftTimeline`, its resumability and its span. Like vLLM's ``Request`` it does no I/O: its
owners call the instances and write the logs.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace

from opentelemetry import trace
from opentelemetry.context import Context

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import FinishReason, SamplingParams
from pdserve.gateway.fleet.backend import FinishedEvent
from pdserve.gateway.phases import TtftTimeline
from pdserve.gateway.progress import CompletionProgress, RequestState
from pdserve.gateway.request import GenerationEnd, GenerationRequest, Resumable


@dataclass
class ActiveRequest:
    """A request in flight: what it asks for, how far it got, and what bounds it.

    Attributes:
        request: The prepared request (its seed is fixed).
        deadline: ``loop.time()`` by which the request must be done, retries included.
        span: The request's span: routing and each attempt become its children.
        timeline: Where its time to first token goes.
        resumable: Set for a resumable request (`Resumable`): its decode keeps it when the
            gateway goes away, and with ``attach_to`` it first attaches where another gateway
            left it.
        progress: The completion tokens delivered so far, exact across attempts.
        state: Its attempts, exclusions and reschedules (the next one set by each decision).
        queued_s: Seconds it waited in the admission queue, over all its attempts.
        context: The trace context under its span (the parent of its child spans).
    """

    request: GenerationRequest
    deadline: float
    span: trace.Span = trace.INVALID_SPAN
    timeline: TtftTimeline = field(default_factory=TtftTimeline)
    resumable: Resumable | None = None
    progress: CompletionProgress = field(init=False)
    state: RequestState = field(default_factory=RequestState)
    queued_s: float = 0.0
    context: Context = field(init=False)

    def __post_init__(self) -> None:
        self.progress = CompletionProgress(self.request)
        self.context = trace.set_span_in_context(self.span)

    @property
    def request_id(self) -> str:
        """The gateway's id of the request, the same for every attempt."""
        return self.request.request_id

    @property
    def is_new(self) -> bool:
        """No completion token was delivered yet."""
        return self.progress.num_tokens == 0

    @property
    def is_left(self) -> bool:
        """A resumable request its gateway leaves to others: its decode lease is kept."""
        return self.resumable is not None and self.resumable.is_left

    def remaining_s(self) -> float:
        """Seconds left until the deadline.

        Raises:
            PdserveError: DEADLINE_EXCEEDED once none are left.
        """
        remaining = self.deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            raise PdserveError(
                ErrorReason.DEADLINE_EXCEEDED,
                "the request did not finish within the gateway's request timeout",
                {"requestId": self.request_id},
            )
        return remaining

    def on_queue_wait(self, waited_s: float) -> None:
        """It waited `waited_s` in the admission queue (before its first token, the wait
        counts in its time to first token too)."""
        self.queued_s += waited_s
        self.timeline.on_queue_wait(waited_s)

    def start_attempt(self) -> int:
        """Counts a new attempt; returns its number (1 for the first)."""
        self.state = replace(self.state, num_attempts=self.state.num_attempts + 1)
        return self.state.num_attempts

    def continuation_sampling(self) -> SamplingParams:
        """The sampling settings of the next Prefill call.

        The prompt's logprobs went out with the first token: a continuation does not score
        the prompt again (and may reuse the prefix cache).
        """
        sampling = self.request.sampling
        if self.is_new:
            return sampling
        return replace(sampling, prompt_logprobs=None)

    def end(self, finished: FinishedEvent | None = None) -> GenerationEnd:
        """The completion's end: the gateway's own finish reason first, else the instance's.

        Args:
            finished: The instance's terminal event, if one came.
        """
        reason = self.progress.finish_reason
        if reason is None and finished is not None:
            reason = finished.finish_reason
        return GenerationEnd(
            finish_reason=reason or FinishReason.STOP,
            num_completion_tokens=self.progress.num_tokens,
            num_cached_prompt_tokens=finished.num_cached_prompt_tokens if finished else 0,
            num_attempts=self.state.num_attempts,
            num_reschedules=self.state.num_reschedules,
            queued_s=self.queued_s,
        )
