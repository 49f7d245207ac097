"""OpenTelemetry tracing for every service: off by default, OTLP/gRPC export when asked.

`configure_tracing` installs an SDK tracer provider when an OTLP endpoint is given (flag or the
standard ``OTEL_*`` variables); otherwise the API's no-op tracer stays in place and spans cost
next to nothing. Once tracing is on, `pdserve.common.grpc_server` adds the server interceptor of
`opentelemetry-instrumentation-grpc` to every server (a SERVER span per request-path RPC, its
parent read from the caller's ``traceparent`` metadata). Channels get no interceptor: a caller
passes its trace context explicitly, either as `client_span` (a CLIENT span whose context goes
out as metadata; the gateway's calls) or as `outgoing_metadata` (the context of a span of its
own that covers the call; the prefill's ``prefill.allocate`` and ``prefill.kv_transfer``).
Hand-made spans use `tracer(name)`; attributes of our own carry the ``pdserve.`` prefix, and
every span of a request carries ``pdserve.request_id`` (`REQUEST_ID`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any, NamedTuple

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from pdserve.common import env

REQUEST_ID = "pdserve.request_id"
"""The attribute that every span of a request carries, in every service."""
API_KEY_NAME = "pdserve.api_key_name"
"""The name of the API key a gateway request authenticated with (never the key)."""

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
    if _provider is not None:
        # NOTE: one provider per process; several in-process services (tests) share it.
        for processor in processors or ():
            _provider.add_span_processor(processor)
        return True
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


_client_tracer = tracer("pdserve.grpc")


def add_trace_ids(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: adds ``trace_id`` and ``span_id`` of the current span, if any."""
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        event.setdefault("trace_id", format(context.trace_id, "032x"))
        event.setdefault("span_id", format(context.span_id, "016x"))
    return event


# Control-plane RPCs that are not traced: health checks, registry heartbeats, status polls,
# model-info fetches. Every request-path RPC is.
UNTRACED_SERVICES = (
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "pdserve.v1.RegistryService",
    "pdserve.v1.InstanceService",
)
UNTRACED_METHODS = (
    "/pdserve.v1.PrefillService/GetModelInfo",
    "/pdserve.v1.GenerationService/ListModels",
)


def server_interceptor() -> Any:
    """The OpenTelemetry aio server interceptor: a server span per RPC, its parent taken from
    the caller's ``traceparent`` metadata (health, registry and status RPCs excluded)."""
    from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters

    untraced = filters.any_of(
        *(filters.service_name(name) for name in UNTRACED_SERVICES),
        *(filters.full_method_name(name) for name in UNTRACED_METHODS),
    )
    return aio_server_interceptor(filter_=filters.negate(untraced))


def outgoing_metadata(ctx: Context | None = None) -> list[tuple[str, str]]:
    """The W3C trace context of `ctx` (default: the current one) as gRPC metadata.

    Empty when tracing is off, so calls carry nothing extra.
    """
    if _provider is None:
        return []
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return list(carrier.items())


class ClientSpan(NamedTuple):
    """The CLIENT span of one outgoing call and the gRPC metadata that carries its context."""

    span: trace.Span
    metadata: tuple[tuple[str, str], ...]


@contextmanager
def client_span(
    full_method: str, address: str, request_id: str, parent: Context | None = None
) -> Iterator[ClientSpan]:
    """A CLIENT span around one outgoing request-path RPC, named like the server's span.

    The span is not made current, so the block may ``yield`` (async generators). Send
    ``metadata`` with the call: the server's span becomes the child of this one. The span ends
    with the block and records ``rpc.grpc.status_code``: OK; the code of a `grpc.RpcError`
    that leaves the block (status ERROR); or CANCELLED when the caller stopped early (a closed
    stream, a cancelled task), which is not an error.

    Args:
        full_method: ``/package.Service/Method``.
        address: ``HOST:PORT`` of the server.
        request_id: The request the call belongs to.
        parent: The caller's trace context (default: the current one).
    """
    service, _, method = full_method.lstrip("/").partition("/")
    host, _, port = address.rpartition(":")
    attributes: dict[str, str | int] = {
        "rpc.system": "grpc",
        "rpc.service": service,
        "rpc.method": method,
        "server.address": host or address,
        REQUEST_ID: request_id,
    }
    if port.isdigit():
        attributes["server.port"] = int(port)
    span = _client_tracer.start_span(
        full_method, context=parent, kind=trace.SpanKind.CLIENT, attributes=attributes
    )
    code = grpc.StatusCode.OK
    try:
        yield ClientSpan(span, tuple(outgoing_metadata(trace.set_span_in_context(span, parent))))
    except grpc.RpcError as error:
        code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
        span.set_status(trace.Status(trace.StatusCode.ERROR, code.name))
        raise
    except (GeneratorExit, asyncio.CancelledError):
        code = grpc.StatusCode.CANCELLED
        raise
    except BaseException as error:
        code = grpc.StatusCode.UNKNOWN
        span.set_status(trace.Status(trace.StatusCode.ERROR, type(error).__name__))
        raise
    finally:
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        span.end()


@contextmanager
def activated(span: trace.Span) -> Iterator[None]:
    """Makes `span` current for a synchronous block (e.g. creating a task or a call that
    copies the current context); safe inside generators because nothing awaits in between."""
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        yield
    finally:
        otel_context.detach(token)


def trace_fields(span: trace.Span) -> dict[str, str]:
    """``trace_id`` / ``span_id`` of `span` for log lines (empty when not recording)."""
    span_context = span.get_span_context()
    if not span_context.is_valid:
        return {}
    return {
        "trace_id": format(span_context.trace_id, "032x"),
        "span_id": format(span_context.span_id, "016x"),
    }
