"""Throughput of a pdserve cluster with tracing off vs on (OTLP to a local sink), same run.

Starts the cluster twice as separate processes (gateway + 1 prefill + 1 decode on the demo
model), sends the same requests at a fixed concurrency, and reports completion tokens/s. With
tracing on, every span is exported over OTLP/gRPC to an in-process receiver that drops them.

    .venv/bin/python bench/tracing_overhead.py [--requests 48] [--concurrency 8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from concurrent import futures

import grpc
import httpx
from common import write_results
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from pdserve.engine.demo import ensure_demo_model
from pdserve.launcher.cluster import Cluster
from pdserve.launcher.config import ClusterConfig


class _Sink(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.num_spans = 0

    def Export(self, request, context):
        self.num_spans += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
        return trace_service_pb2.ExportTraceServiceResponse()


async def _load(url: str, num_requests: int, concurrency: int, max_tokens: int) -> float:
    semaphore = asyncio.Semaphore(concurrency)
    num_tokens = 0
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def one(i: int) -> None:
            nonlocal num_tokens
            async with semaphore:
                body = {"model": "demo-llama-v1", "prompt": f"request {i} " * 8,
                        "max_tokens": max_tokens, "temperature": 0}  # fmt: skip
                response = await client.post("/v1/completions", json=body)
                response.raise_for_status()
                num_tokens += response.json()["usage"]["completion_tokens"]

        await one(-1)  # warm-up
        num_tokens = 0
        started = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(num_requests)))
        return num_tokens / (time.perf_counter() - started)


def _measure(env: dict[str, str], args: argparse.Namespace, model: str) -> float:
    with tempfile.TemporaryDirectory() as logs:
        config = ClusterConfig(model=model, port=0, grpc_port=0, internal_port=0, log_dir=logs)
        cluster = Cluster(config, env=env)
        cluster.start()
        try:
            return asyncio.run(
                _load(cluster.rest_url, args.requests, args.concurrency, args.max_tokens)
            )
        finally:
            cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="alternating off/on rounds")
    args = parser.parse_args()
    model = str(ensure_demo_model())
    sink = _Sink()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    plain = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    traced = {**plain, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"}
    off, on = [], []
    for _ in range(args.rounds):
        off.append(_measure(plain, args, model))
        on.append(_measure(traced, args, model))
    server.stop(None)
    result = {
        "tracing_off_tok_s": statistics.median(off),
        "tracing_on_tok_s": statistics.median(on),
        "ratio_on_over_off": statistics.median(on) / statistics.median(off),
        "num_spans_exported": sink.num_spans,
        "runs_off": off,
        "runs_on": on,
        "args": vars(args),
    }
    print(f"{'tracing':>8} {'completion tok/s (median)':>26}")
    print(f"{'off':>8} {result['tracing_off_tok_s']:>26.1f}")
    print(f"{'on':>8} {result['tracing_on_tok_s']:>26.1f}")
    print(f"ratio on/off: {result['ratio_on_over_off']:.3f}; spans exported: {sink.num_spans}")
    print("results:", write_results("tracing_overhead", result))


if __name__ == "__main__":
    main()
