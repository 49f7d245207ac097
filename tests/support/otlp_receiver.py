"""An in-process OTLP/gRPC trace receiver: what Jaeger or Phoenix would be sent, kept in memory.

`otlp_receiver()` serves the OTLP ``TraceService`` on 127.0.0.1 (port picked by the OS); point a
service at it with ``OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:PORT``. Every exported span
becomes a `ReceivedSpan`; `OtlpReceiver.wait_for` polls a condition over them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span, ids in hex (``parent_id`` is "" for a root)."""

    service: str
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: str
    attributes: dict[str, Any]
    events: tuple[str, ...]


def _value(value: common_pb2.AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(item) for item in value.array_value.values]
    return getattr(value, kind) if kind else None


def _span(service: str, span: trace_pb2.Span) -> ReceivedSpan:
    return ReceivedSpan(
        service=service,
        trace_id=span.trace_id.hex(),
        span_id=span.span_id.hex(),
        parent_id=span.parent_span_id.hex(),
        name=span.name,
        kind=trace_pb2.Span.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_"),
        attributes={a.key: _value(a.value) for a in span.attributes},
        events=tuple(event.name for event in span.events),
    )


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Implements ``opentelemetry.proto.collector.trace.v1.TraceService``; remembers spans."""

    def __init__(self) -> None:
        self.port = 0
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            service = str(resource.get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                received.extend(_span(service, span) for span in scope_spans.spans)
        with self._lock:
            self._spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()

    @property
    def endpoint(self) -> str:
        """The value for ``OTEL_EXPORTER_OTLP_ENDPOINT``."""
        return f"http://127.0.0.1:{self.port}"

    def spans(self) -> list[ReceivedSpan]:
        """Every span received so far, in arrival order."""
        with self._lock:
            return list(self._spans)

    def wait_for(
        self, condition: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 20.0
    ) -> list[ReceivedSpan]:
        """Polls until `condition(spans)` holds; returns the spans then.

        Raises:
            AssertionError: When it does not hold within `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.spans()
            if condition(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted({(s.service, s.name) for s in spans})
                raise AssertionError(f"spans never satisfied the condition; received {names}")
            time.sleep(0.1)


@contextmanager
def otlp_receiver() -> Iterator[OtlpReceiver]:
    """Serves an `OtlpReceiver` on loopback for the duration of the block."""
    receiver = OtlpReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    receiver.port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield receiver
    finally:
        server.stop(grace=None)
