"""Separate gateway, prefill and decode processes export OTLP to one receiver: one trace."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from pdserve.launcher.cluster import Cluster, ClusterConfig


class _Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """A minimal OTLP/gRPC trace receiver: remembers (service.name, trace id, span name)."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, str]] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                attributes = {
                    a.key: a.value.string_value for a in resource_spans.resource.attributes
                }
                service = attributes.get("service.name", "")
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append((service, span.trace_id.hex(), span.name))
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def receiver() -> Iterator[tuple[_Receiver, int]]:
    servicer = _Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(grace=None)


def test_one_request_is_one_trace_across_processes(
    demo_model_dir: Path, tmp_path: Path, receiver: tuple[_Receiver, int]
) -> None:
    servicer, port = receiver
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"}
    config = ClusterConfig(model=str(demo_model_dir), port=0, grpc_port=0, log_dir=str(tmp_path))
    cluster = Cluster(config, env=env)
    cluster.start()
    try:
        body = {"model": "demo-llama-v1", "prompt": "trace me", "max_tokens": 4}
        httpx.post(f"{cluster.rest_url}/v1/completions", json=body, timeout=60).raise_for_status()
        deadline = time.monotonic() + 20
        services: set[str] = set()
        while time.monotonic() < deadline:
            with servicer.lock:
                roots = [t for s, t, n in servicer.spans if n == "gateway.request"]
                if roots:
                    services = {s for s, t, _ in servicer.spans if t == roots[0]}
            if {"pdserve-gateway", "pdserve-prefill", "pdserve-decode"} <= services:
                break
            time.sleep(0.2)
    finally:
        cluster.stop(timeout_s=20)
    assert {"pdserve-gateway", "pdserve-prefill", "pdserve-decode"} <= services
