"""Runs a traced in-process cluster and prints what was recorded, as one JSON document.

Tracing is process-wide (one tracer provider), so tests run this module in a child process:
``python -m support.trace_scenario MODEL_DIR SCENARIO``. Scenarios: ``chat`` (one chat request
with an incoming ``traceparent``, then polls of a gateway started with ``trace_polls``) and
``preemption`` (streams on a tiny decode pool).
"""

from __future__ import annotations

import asyncio
import io
import json
import sys
from contextlib import redirect_stderr
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.common.logging import configure_logging
from pdserve.common.telemetry import configure_tracing

INCOMING_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
INCOMING_SPAN_ID = "00f067aa0ba902b7"
POLLS = ("/health", "/v1/models", "/metrics")


def _span_record(span: Any) -> dict[str, Any]:
    return {
        "name": span.name,
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "scope": span.instrumentation_scope.name if span.instrumentation_scope else "",
        "trace_id": format(span.context.trace_id, "032x"),
        "span_id": format(span.context.span_id, "016x"),
        "parent_id": format(span.parent.span_id, "016x") if span.parent else None,
        "attributes": {k: v if isinstance(v, str | int | float | bool) else list(v)
                       for k, v in (span.attributes or {}).items()},
        "events": [event.name for event in span.events],
    }  # fmt: skip


async def _chat(cluster: Any) -> None:
    async with cluster.http() as http:
        response = await http.post(
            "/v1/chat/completions",
            json={"model": "demo", "messages": [{"role": "user", "content": "Hi"}],
                  "max_tokens": 8, "temperature": 0},
            headers={"traceparent": f"00-{INCOMING_TRACE_ID}-{INCOMING_SPAN_ID}-01"},
        )  # fmt: skip
        response.raise_for_status()
        for path in POLLS:
            await http.get(path)


async def _preemption(cluster: Any) -> None:
    async with cluster.http() as http:

        async def one(i: int) -> None:
            body = {"model": "demo", "prompt": f"story number {i}", "max_tokens": 48,
                    "temperature": 0}  # fmt: skip
            (await http.post("/v1/completions", json=body)).raise_for_status()

        await asyncio.gather(*(one(i) for i in range(6)))


async def main(model_dir: Path, scenario: str) -> dict[str, Any]:
    from support.real_cluster import RealCluster

    options: dict[str, Any] = {"trace_polls": True}
    if scenario == "preemption":
        options = {"decode_overrides": [{"num_blocks": 16, "reserve_tokens": 0}],
                   "preempt_retry_count": 50}  # fmt: skip
    cluster = RealCluster(model_dir)
    await cluster.start(**options)
    try:
        await (_chat if scenario == "chat" else _preemption)(cluster)
        await asyncio.sleep(0.3)  # let servers close their spans
    finally:
        await cluster.close()
    return {}


if __name__ == "__main__":
    exporter = InMemorySpanExporter()
    configure_tracing("pdserve-test", processors=[SimpleSpanProcessor(exporter)])
    logs = io.StringIO()
    with redirect_stderr(logs):
        configure_logging("test", "info")
        asyncio.run(main(Path(sys.argv[1]), sys.argv[2]))
    lines = [json.loads(line) for line in logs.getvalue().splitlines() if line.startswith("{")]
    spans = [_span_record(span) for span in exporter.get_finished_spans()]
    print(json.dumps({"spans": spans, "logs": lines}))
