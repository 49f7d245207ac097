"""One trace per request across gateway, prefill and decode (in-process, in-memory exporter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.trace_scenario import INCOMING_SPAN_ID, INCOMING_TRACE_ID

TESTS_DIR = Path(__file__).resolve().parents[1]


def _run(model_dir: Path, scenario: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(TESTS_DIR)}
    result = subprocess.run(
        [sys.executable, "-m", "support.trace_scenario", str(model_dir), scenario],
        capture_output=True, text=True, timeout=240, env=env, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def chat(demo_model_dir: Path) -> dict[str, Any]:
    return _run(demo_model_dir, "chat")


def _one(spans: list[dict[str, Any]], name: str) -> dict[str, Any]:
    found = [s for s in spans if s["name"] == name]
    assert len(found) == 1, f"{name}: {len(found)} spans"
    return found[0]


def test_chat_request_is_one_trace_across_three_services(chat: dict[str, Any]) -> None:
    spans = chat["spans"]
    assert {s["trace_id"] for s in spans} == {INCOMING_TRACE_ID}
    by_id = {s["span_id"]: s for s in spans}

    def parent(span: dict[str, Any]) -> dict[str, Any]:
        return by_id[span["parent_id"]]

    root = _one(spans, "gateway.request")
    assert root["parent_id"] == INCOMING_SPAN_ID  # joined the caller's trace
    attempt = _one(spans, "gateway.attempt")
    assert parent(attempt) is root and "first_token" in attempt["events"]
    assert parent(_one(spans, "gateway.route")) is root

    prefill_rpc = _one(spans, "/pdserve.v1.PrefillService/Prefill")
    assert parent(prefill_rpc) is attempt
    allocate = _one(spans, "prefill.allocate")
    assert parent(allocate) is prefill_rpc
    assert parent(_one(spans, "/pdserve.v1.DecodeService/AllocateBlocks")) is allocate

    transfer = _one(spans, "prefill.kv_transfer")
    assert parent(transfer) is prefill_rpc
    assert transfer["attributes"]["pdserve.kv.num_bytes"] > 0
    assert transfer["attributes"]["pdserve.kv.num_chunks"] > 0
    sync = _one(spans, "/pdserve.v1.DecodeService/SyncCache")
    assert parent(sync) is transfer
    assert (
        sync["attributes"]["pdserve.kv.num_bytes"] == transfer["attributes"]["pdserve.kv.num_bytes"]
    )

    compute = _one(spans, "prefill.compute")
    chunks = [s for s in spans if s["name"] == "prefill.chunk"]
    assert chunks and all(parent(c) is compute for c in chunks)
    assert parent(_one(spans, "prefill.queue_wait")) is compute

    generate = _one(spans, "/pdserve.v1.DecodeService/Generate")
    assert parent(generate) is attempt


def test_log_lines_carry_the_trace_id(chat: dict[str, Any]) -> None:
    finished = [line for line in chat["logs"] if line.get("event") == "request_finished"]
    assert finished and finished[0]["trace_id"] == INCOMING_TRACE_ID
    handed_off = [line for line in chat["logs"] if line.get("event") == "handed_off"]
    assert handed_off and handed_off[0]["trace_id"] == INCOMING_TRACE_ID


def test_preemption_shows_as_events_and_a_second_attempt(demo_model_dir: Path) -> None:
    spans = _run(demo_model_dir, "preemption")["spans"]
    roots = {s["span_id"]: s for s in spans if s["name"] == "gateway.request"}
    retried = [r for r in roots.values() if "retry" in r["events"]]
    assert retried, "no request was retried"
    root = retried[0]
    attempts = [
        s for s in spans if s["name"] == "gateway.attempt" and s["parent_id"] == root["span_id"]
    ]
    assert len(attempts) >= 2
    assert any("preemption" in a["events"] for a in attempts)
    assert {a["trace_id"] for a in attempts} == {root["trace_id"]}
