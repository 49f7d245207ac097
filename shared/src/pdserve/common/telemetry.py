"""OpenTelemetry tracing for every service: off by default, OTLP/gRPC export when asked.

`configure_tracing` installs an SDK tracer provider when an OTLP endpoint is given (flag or the
standard ``OTEL_*`` variables); otherwise the API's no-op tracer stays in place and spans cost
next to nothing. The W3C ``traceparent`` travels in gRPC metadata through the interceptors of
`opentelemetry-instrumentation-grpc`, which `pdserve.common.grpc_server` adds to every server
and channel once tracing is on. Hand-made spans use `tracer(name)`; attributes of our own
carry the ``pdserve.`` prefix.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from pdserve.common import env

_provider: TracerProvider | None = None


def is_enabled() -> bool:
    """Whether this process exports spans (an SDK provider is installed)."""
    return _provider is not None


def configure_tracing(
    service_name: str,
    otlp_endpoint: str | None = None,
    sample_ratio: float | None = None,
    processors: list[SpanProcessor] | None = None,
) -> bool:
    """Turns tracing on when an endpoint or span processors are given.

    Args:
        service_name: The ``service.name`` resource attribute, e.g. "pdserve-decode".
        otlp_endpoint: OTLP/gRPC collector, e.g. "localhost:4317"; falls back to the standard
            ``OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT`` / ``OTEL_TRACES_EXPORTER`` variables.
        sample_ratio: Fraction of new traces to keep (parent-based); None keeps all, unless
            ``OTEL_TRACES_SAMPLER`` says otherwise.
        processors: Extra span processors (tests use an in-memory exporter).

    Returns:
        True if tracing is on.
    """
    global _provider
    endpoint = otlp_endpoint or env.otlp_traces_endpoint()
    if endpoint is None and not processors:
        return False
    if sample_ratio is not None and not 0.0 <= sample_ratio <= 1.0:
        raise ValueError(f"sample_ratio must be in [0, 1], got {sample_ratio}")
    sampler = None if sample_ratio is None else ParentBased(TraceIdRatioBased(sample_ratio))
    provider = TracerProvider(
        resource=Resource.create({"service.name": service_name}), sampler=sampler
    )
    if endpoint is not None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        insecure = not endpoint.startswith("https://")
        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=insecure)
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    for processor in processors or ():
        provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    _provider = provider
    return True


def shutdown_tracing() -> None:
    """Flushes and stops the exporter (call before the process exits)."""
    if _provider is not None:
        _provider.shutdown()


def tracer(name: str) -> trace.Tracer:
    """A tracer for instrumentation scope `name` (e.g. "pdserve.decode")."""
    return trace.get_tracer(name)


def add_trace_ids(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: adds ``trace_id`` and ``span_id`` of the current span, if any."""
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        event.setdefault("trace_id", format(context.trace_id, "032x"))
        event.setdefault("span_id", format(context.span_id, "016x"))
    return event
