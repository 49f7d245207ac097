"""Running a prepared request: orchestrate, detokenize, and record its outcome.

`Streamer.stream` runs one `PreparedRequest` through the orchestrator and turns its tokens into
`OutputDelta`s (`pdserve.gateway.output_deltas`). It owns what the gateway
records of a request: the ``gateway.request`` span, the latency metrics (with where the time
to first token went, `TtftTimeline`), the outcome counter and one log line per outcome
(``request_finished``, ``request_failed``, ``request_cancelled``). It also counts the requests
streaming, so a draining gateway can wait for them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

import structlog
from opentelemetry import trace
from opentelemetry.context import Context

from pdserve.common import telemetry
from pdserve.common.errors import PdserveError
from pdserve.common.generation import resolve_seed
from pdserve.gateway.active_request import ActiveRequest
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.orchestrator import Orchestrator, next_part
from pdserve.gateway.output_deltas import final_delta, text_deltas
from pdserve.gateway.phases import TtftTimeline
from pdserve.gateway.prepare.params import PreparedRequest, PromptKind
from pdserve.gateway.reasoning import ReasoningStream
from pdserve.gateway.relay import AttemptFailed
from pdserve.gateway.request import GenerationEnd, OutputDelta, Resumable
from pdserve.gateway.tool_deltas import ToolCallStream

log = structlog.get_logger("pdserve.gateway.streaming")
_tracer = telemetry.tracer("pdserve.gateway")


class Streamer:
    """Runs prepared requests and records each one; counts those in flight.

    Args:
        orchestrator: Runs requests.
        metrics: Latency histograms and outcome counters.
        request_timeout_s: Bound of one request, retries included.
    """

    def __init__(
        self, orchestrator: Orchestrator, metrics: GatewayMetrics, request_timeout_s: float
    ) -> None:
        self._orchestrator = orchestrator
        self._metrics = metrics
        self._request_timeout_s = request_timeout_s
        self._num_active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def num_active_requests(self) -> int:
        """Requests streaming right now."""
        return self._num_active

    async def wait_idle(self, timeout_s: float) -> bool:
        """Waits until no request is streaming; returns False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def stream(
        self,
        prepared: PreparedRequest,
        trace_context: Context | None = None,
        resumable: Resumable | None = None,
        index: int = 0,
    ) -> AsyncGenerator[tuple[int, OutputDelta], None]:
        """Runs a prepared request under its span ``gateway.request``.

        Args:
            prepared: From `Frontend.prepare`.
            index: Its choice index, which tags each of its deltas (``n`` > 1 or several
                prompts: `pdserve.gateway.choices` interleaves them by it).
            trace_context: Parent of the request's span (default: the current context).
            resumable: For a resumable request (`pdserve.gateway.session`): its decode keeps it
                if this gateway goes away, and each delta holds exactly one token, so its
                deltas (and the events made of them) are a function of its tokens alone,
                however they were batched, whichever gateway runs it.

        Returns:
            ``(index, delta)``: deltas of text and tokens (with the tool calls read out, for
            a request with a tool plan: `pdserve.gateway.tool_deltas`); the last one has
            finish_reason and usage. Iterating raises the `PdserveError` that ended the request.
        """
        return self._stream(prepared, trace_context, resumable, index)

    async def _stream(
        self,
        prepared: PreparedRequest,
        trace_context: Context | None,
        resumable: Resumable | None,
        index: int,
    ) -> AsyncGenerator[tuple[int, OutputDelta], None]:
        request = prepared.request
        loop = asyncio.get_running_loop()
        started = loop.time()
        text = prepared.completion_text()
        # NOTE: the calls are read here, not around this generator, so that what is recorded
        # (the log line, the span) has the finish reason the client gets (``tool_calls``).
        plan = prepared.tool_plan
        calls = None if plan is None else ToolCallStream(plan, request.request_id)
        reasoning = (
            None if prepared.reasoning_opens is None else ReasoningStream(prepared.reasoning_opens)
        )

        def as_sent(delta: OutputDelta) -> OutputDelta:
            if reasoning is not None:
                delta = reasoning.step(delta)
            return delta if calls is None else calls.step(delta)

        end: GenerationEnd | None = None
        outcome = "cancelled"
        self._num_active += 1
        self._idle.clear()
        span = _tracer.start_span(
            "gateway.request", context=trace_context, attributes=_request_attributes(prepared)
        )
        request_log = log.bind(
            **telemetry.trace_fields(span),
            request_id=request.request_id,
            client_request_id=prepared.client_request_id,
            api_key_name=prepared.api_key_name,
        )
        last_token_at: float | None = None
        timeline = TtftTimeline(arrival=prepared.arrival_time)
        try:
            deadline = started + self._request_timeout_s
            active = ActiveRequest(request, deadline, span, timeline, resumable)
            # NOTE: each step's stream is drained here, so a token passes through no level of
            # the orchestrator; a failed stream goes back to it (`next_part`).
            parts = self._orchestrator.parts(active)
            async with contextlib.aclosing(parts):
                failure: AttemptFailed | None = None
                is_cut = False
                while not is_cut:
                    part = await next_part(parts, failure)
                    if isinstance(part, GenerationEnd):
                        end = part
                        break
                    failure = None
                    try:
                        async for event in part:
                            now = loop.time()
                            if last_token_at is None:
                                self._metrics.ttft.observe(now - started)
                            elif event.token_ids:
                                gap = (now - last_token_at) / len(event.token_ids)
                                for _ in event.token_ids:
                                    self._metrics.inter_token_latency.observe(gap)
                            last_token_at = now
                            if prepared.is_prompt_only:
                                # NOTE: max_tokens 0: the sampled token only finished the prefill.
                                logprobs = event.prompt_logprobs
                                yield (
                                    index,
                                    as_sent(OutputDelta("", (), 0, prompt_logprobs=logprobs)),
                                )
                                is_cut = True
                                break
                            for delta in text_deltas(text, event, one_by_one=resumable is not None):
                                yield index, as_sent(delta)
                                timeline.on_first_token_written()
                            if text.is_stopped:
                                is_cut = True
                                break
                    except AttemptFailed as failed:
                        failure = failed
            final = as_sent(final_delta(prepared, text, end))
            finish_reason, usage = final.finish_reason, final.usage
            assert finish_reason is not None and usage is not None
            outcome = "finished"
            span.set_attributes(
                {
                    "gen_ai.response.model": request.model,
                    "gen_ai.usage.output_tokens": usage.num_completion_tokens,
                    "gen_ai.response.finish_reasons": [finish_reason.value],
                }
            )
            self._metrics.e2e_latency.observe(loop.time() - started)
            request_log.info(
                "request_finished",
                user=prepared.user,
                model=request.model,
                finish_reason=finish_reason.value,
                is_stop_string=text.is_stopped,
                num_prompt_tokens=usage.num_prompt_tokens,
                num_completion_tokens=usage.num_completion_tokens,
                num_attempts=end.num_attempts if end else None,
                num_reschedules=end.num_reschedules if end else None,
                queued_s=round(end.queued_s, 4) if end else None,
                duration_s=round(loop.time() - started, 4),
            )
            yield index, final
        except PdserveError as error:
            outcome = error.reason.name
            span.set_status(trace.Status(trace.StatusCode.ERROR, error.reason.name))
            span.set_attribute("pdserve.error.reason", error.reason.name)
            request_log.warning(
                "request_failed",
                model=request.model,
                reason=error.reason.name,
                message=error.message,
                num_completion_tokens=text.num_tokens,
                duration_s=round(loop.time() - started, 4),
            )
            raise
        finally:
            if outcome == "cancelled":
                span.add_event("cancelled")
                request_log.info(
                    "request_cancelled",
                    num_completion_tokens=text.num_tokens,
                    duration_s=round(loop.time() - started, 4),
                )
            self._metrics.requests.labels(outcome=outcome).inc()
            if timeline.first_token_written is not None:
                timeline.record(self._metrics.ttft_phase_seconds, span)
            span.end()
            self._num_active -= 1
            if self._num_active == 0:
                self._idle.set()


def _request_attributes(prepared: PreparedRequest) -> dict[str, str | int | float | list[str]]:
    """The request span's attributes known up front (OpenTelemetry GenAI conventions)."""
    request = prepared.request
    sampling = request.sampling
    attributes: dict[str, str | int | float | list[str]] = {
        telemetry.REQUEST_ID: request.request_id,
        "gen_ai.operation.name": "chat" if prepared.kind is PromptKind.CHAT else "text_completion",
        "gen_ai.request.model": request.model,
        "gen_ai.request.max_tokens": sampling.max_tokens,
        "gen_ai.request.seed": resolve_seed(sampling.seed),
        "gen_ai.request.temperature": sampling.temperature,
        "gen_ai.request.top_p": sampling.top_p,
        "gen_ai.request.top_k": sampling.top_k,
        "gen_ai.usage.input_tokens": len(request.prompt_token_ids),
    }
    if prepared.n > 1:
        attributes["gen_ai.request.choice.count"] = prepared.n
    if sampling.presence_penalty:
        attributes["gen_ai.request.presence_penalty"] = sampling.presence_penalty
    if sampling.frequency_penalty:
        attributes["gen_ai.request.frequency_penalty"] = sampling.frequency_penalty
    if sampling.repetition_penalty != 1.0:
        attributes["pdserve.repetition_penalty"] = sampling.repetition_penalty
    if sampling.logit_bias:
        attributes["pdserve.num_logit_bias"] = len(sampling.logit_bias)
    if sampling.logprobs is not None:
        attributes["pdserve.logprobs"] = sampling.logprobs
    if sampling.prompt_logprobs is not None:
        attributes["pdserve.prompt_logprobs"] = sampling.prompt_logprobs
    if prepared.stop:
        attributes["gen_ai.request.stop_sequences"] = list(prepared.stop)
    if prepared.api_key_name is not None:
        attributes[telemetry.API_KEY_NAME] = prepared.api_key_name
    return attributes
