"""Trace spans of a prefill step: one ``prefill.chunk`` per scheduled chunk, and the
``prefill.queue_wait`` of a request's first chunk."""

from __future__ import annotations

import time

from opentelemetry import trace

from pdserve.common import telemetry
from pdserve.engine.batch import ScheduledChunk
from pdserve.prefill.request import Request

_tracer = telemetry.tracer("pdserve.prefill")


def chunk_spans(scheduled: list[ScheduledChunk[Request]]) -> list[trace.Span]:
    """Starts a ``prefill.chunk`` span per scheduled chunk (and, for a request's first chunk,
    records its ``prefill.queue_wait``), each under its request's trace context."""
    now_ns = time.time_ns()
    spans = []
    for chunk in scheduled:
        request = chunk.request
        if request.trace_context is None:
            continue
        num_reused = request.num_cached_tokens + request.num_loaded_tokens
        if chunk.num_computed_tokens == num_reused and request.submitted_ns:
            # NOTE: the request's first chunk: say on its compute span how much was reused.
            trace.get_current_span(request.trace_context).set_attributes(
                {"pdserve.cached_tokens": request.num_cached_tokens,
                 "pdserve.loaded_tokens": request.num_loaded_tokens}
            )  # fmt: skip
            waited = _tracer.start_span(
                "prefill.queue_wait",
                context=request.trace_context,
                start_time=request.submitted_ns,
                attributes={telemetry.REQUEST_ID: request.request_id},
            )
            waited.end(end_time=now_ns)
        spans.append(
            _tracer.start_span(
                "prefill.chunk",
                context=request.trace_context,
                start_time=now_ns,
                attributes={
                    telemetry.REQUEST_ID: request.request_id,
                    "pdserve.num_tokens": chunk.num_new_tokens,
                    "pdserve.start_position": chunk.num_computed_tokens,
                    "pdserve.num_batched_requests": len(scheduled),
                },
            )
        )
    return spans
