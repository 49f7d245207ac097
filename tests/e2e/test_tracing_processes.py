"""Gateway, prefill and decode processes export OTLP/gRPC to one receiver, as to Jaeger or
Phoenix: each generation request is exactly one trace across the three services (a client's
``traceparent`` is its parent), and polls of /health, /v1/models and /metrics make none."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest
from support.otlp_receiver import ReceivedSpan, otlp_receiver

from pdserve.launcher.cluster import Cluster
from pdserve.launcher.config import ClusterConfig

SERVICES = {"pdserve-gateway", "pdserve-prefill", "pdserve-decode"}
CLIENT_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN_ID = "b7ad6b7169203331"
POLLS = ("/health", "/v1/models", "/metrics")
NUM_TOKENS = 6


class Exported(NamedTuple):
    """What the receiver got, and the request id (``X-Request-Id``) of each request."""

    spans: list[ReceivedSpan]
    request_ids: dict[str, str]


@pytest.fixture(scope="module")
def exported(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Exported]:
    """Runs polls and three generation requests against a traced cluster of processes."""
    with otlp_receiver() as receiver:
        env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}
        log_dir = tmp_path_factory.mktemp("tracing-logs")
        config = ClusterConfig(
            model=str(demo_model_dir), port=0, grpc_port=0, internal_port=0, log_dir=str(log_dir)
        )
        cluster = Cluster(config, env=env)
        cluster.start()
        try:
            with httpx.Client(base_url=cluster.rest_url, timeout=60) as http:
                request_ids = _run_requests(http)
            # NOTE: each process exports its spans in the order they ended: once a request's
            # last span from every service is in, so are its others, and once the last
            # request's HTTP span is in, so is every poll span the gateway made before it.
            spans = receiver.wait_for(lambda spans: _is_complete(spans, request_ids.values()))
        finally:
            cluster.stop(timeout_s=20)
    yield Exported(spans, request_ids)


def _run_requests(http: httpx.Client) -> dict[str, str]:
    fixed = {"model": "demo-llama-v1", "max_tokens": NUM_TOKENS, "ignore_eos": True}
    chat = {**fixed, "messages": [{"role": "user", "content": "Hi"}]}
    completion = {**fixed, "prompt": "trace me"}
    traceparent = {"traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"}

    def post(path: str, body: dict[str, object], **headers: str) -> str:
        response = http.post(path, json=body, headers=headers)
        response.raise_for_status()
        return response.headers["x-request-id"]

    def poll() -> None:
        for path in POLLS:
            http.get(path)  # a poll's status does not matter, only that it is untraced

    poll()
    ids = {"chat": post("/v1/chat/completions", chat)}
    poll()
    ids["streamed_chat_with_parent"] = post(
        "/v1/chat/completions", {**chat, "stream": True}, **traceparent
    )
    poll()
    ids["last"] = post("/v1/completions", completion)
    return ids


def _is_complete(spans: list[ReceivedSpan], request_ids: Iterable[str]) -> bool:
    """Whether the last span each service ends for each request has arrived."""
    seen = {(s.name, s.attributes.get("pdserve.request_id")) for s in spans if s.kind == "SERVER"}
    return all(
        {("/pdserve.v1.PrefillService/Prefill", rid), ("/pdserve.v1.DecodeService/Generate", rid)}
        <= seen
        and any(name.startswith("POST ") and r == rid for name, r in seen)
        for rid in request_ids
    )


def _trace_of(spans: list[ReceivedSpan], request_id: str) -> list[ReceivedSpan]:
    (root,) = [s for s in spans if s.name == "gateway.request"
               and s.attributes["pdserve.request_id"] == request_id]  # fmt: skip
    return [s for s in spans if s.trace_id == root.trace_id]


def test_each_request_is_exactly_one_trace_and_polls_make_none(exported: Exported) -> None:
    spans, request_ids = exported
    traces = Counter(s.trace_id for s in spans)
    assert len(traces) == len(request_ids), sorted({s.name for s in spans})
    assert not [s.name for s in spans if s.name.startswith(("GET ", "fastapi."))]
    for request_id in request_ids.values():
        trace = _trace_of(spans, request_id)
        assert {s.service for s in trace} == SERVICES
        assert {s.attributes.get("pdserve.request_id") for s in trace} == {request_id}
        names = Counter(s.name for s in trace)
        assert names["decode.generation"] == 1
        assert names["gateway.request"] == 1
        (http,) = [s for s in trace if s.kind == "SERVER" and s.service == "pdserve-gateway"]
        # one tree: the HTTP server span is its only root, everything else hangs below it
        by_id = {s.span_id: s for s in trace}
        assert [s for s in trace if s.parent_id not in by_id] == [http]
        (request,) = [s for s in trace if s.name == "gateway.request"]
        assert request.parent_id == http.span_id


def test_spans_read_as_genai_requests(exported: Exported) -> None:
    spans, request_ids = exported
    operations = {}
    for key, request_id in request_ids.items():
        trace = _trace_of(spans, request_id)
        (request,) = [s for s in trace if s.name == "gateway.request"]
        operations[key] = request.attributes["gen_ai.operation.name"]
        assert request.attributes["gen_ai.usage.output_tokens"] == NUM_TOKENS
        assert request.attributes["gen_ai.response.finish_reasons"] == ["length"]
        (generation,) = [s for s in trace if s.name == "decode.generation"]
        # the prefill sampled the first token; the decode made the others, one per step
        assert generation.attributes["pdserve.num_generated_tokens"] == NUM_TOKENS - 1
        assert generation.attributes["pdserve.num_steps"] == NUM_TOKENS - 1
        server_rpcs = {s.name for s in trace if s.kind == "SERVER" and s.name.startswith("/")}
        assert {"/pdserve.v1.PrefillService/Prefill", "/pdserve.v1.DecodeService/Generate",
                "/pdserve.v1.DecodeService/SyncCache"} <= server_rpcs  # fmt: skip
    assert operations == {
        "chat": "chat",
        "streamed_chat_with_parent": "chat",
        "last": "text_completion",
    }


def test_a_client_traceparent_is_the_parent_of_the_one_tree(exported: Exported) -> None:
    spans, request_ids = exported
    trace = _trace_of(spans, request_ids["streamed_chat_with_parent"])
    assert {s.trace_id for s in trace} == {CLIENT_TRACE_ID}
    (http,) = [s for s in trace if s.parent_id == CLIENT_SPAN_ID]
    assert http.name == "POST /v1/chat/completions" and http.kind == "SERVER"
