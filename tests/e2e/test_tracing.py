"""One trace per request across gateway, prefill and decode (in-process, in-memory exporter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.trace_scenario import INCOMING_SPAN_ID, INCOMING_TRACE_ID, POLLS

TESTS_DIR = Path(__file__).resolve().parents[1]


def _run(model_dir: Path, scenario: str) -> dict[str, Any]:
    # NOTE: keep the caller's PYTHONPATH after the tests: a checkout that puts its own sources
    # first must run the scenario on them, not on whatever the environment has installed.
    path = os.pathsep.join(p for p in (str(TESTS_DIR), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    result = subprocess.run(
        [sys.executable, "-m", "support.trace_scenario", str(model_dir), scenario],
        capture_output=True, text=True, timeout=240, env=env, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def chat(demo_model_dir: Path) -> dict[str, Any]:
    return _run(demo_model_dir, "chat")


def _one(spans: list[dict[str, Any]], name: str, kind: str | None = None) -> dict[str, Any]:
    found = [s for s in spans if s["name"] == name and kind in (None, s["kind"])]
    assert len(found) == 1, f"{name} {kind or ''}: {len(found)} spans"
    return found[0]


def _request_spans(chat: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in chat["spans"] if s["trace_id"] == INCOMING_TRACE_ID]


def test_chat_request_is_one_trace_across_three_services(chat: dict[str, Any]) -> None:
    spans = _request_spans(chat)
    by_id = {s["span_id"]: s for s in spans}

    def parent(span: dict[str, Any]) -> dict[str, Any]:
        return by_id[span["parent_id"]]

    http = _one(spans, "POST /v1/chat/completions", "SERVER")
    assert http["parent_id"] == INCOMING_SPAN_ID  # joined the caller's trace
    assert [s for s in spans if s["parent_id"] not in by_id] == [http]  # one tree
    root = _one(spans, "gateway.request", "INTERNAL")
    assert parent(root) is http
    assert parent(_one(spans, "gateway.prepare")) is http
    attempt = _one(spans, "gateway.attempt")
    assert parent(attempt) is root and "first_token" in attempt["events"]
    route = _one(spans, "gateway.route")
    assert parent(route) is root
    # NOTE: the first prompt of a fresh cluster: no prefill holds any of it yet.
    assert route["attributes"]["pdserve.route.prefill_reason"] == "load"
    assert route["attributes"]["pdserve.route.matched_blocks"] == 0

    prefill_call = _one(spans, "/pdserve.v1.PrefillService/Prefill", "CLIENT")
    assert parent(prefill_call) is attempt
    assert prefill_call["attributes"]["rpc.grpc.status_code"] == 0
    prefill_rpc = _one(spans, "/pdserve.v1.PrefillService/Prefill", "SERVER")
    assert parent(prefill_rpc) is prefill_call
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

    generate_call = _one(spans, "/pdserve.v1.DecodeService/Generate", "CLIENT")
    assert parent(generate_call) is attempt
    assert parent(_one(spans, "/pdserve.v1.DecodeService/Generate", "SERVER")) is generate_call


def test_decode_work_is_a_span_from_commit_to_finish(chat: dict[str, Any]) -> None:
    spans = _request_spans(chat)
    generation = _one(spans, "decode.generation")
    sync = _one(spans, "/pdserve.v1.DecodeService/SyncCache")
    assert generation["parent_id"] == sync["span_id"]  # the commit starts it
    assert "scheduled" in generation["events"]
    attributes = generation["attributes"]
    assert attributes["pdserve.lease_state"] == "FINISHED"
    assert attributes["pdserve.finish_reason"] == "length"
    # max_tokens 8: the prefill sampled the first token, the decode the other 7, one per step
    assert attributes["pdserve.num_generated_tokens"] == attributes["pdserve.num_steps"] == 7
    # it covers the hand-off: running before the gateway's Generate call starts
    prefill_call = _one(spans, "/pdserve.v1.PrefillService/Prefill", "CLIENT")
    generate_call = _one(spans, "/pdserve.v1.DecodeService/Generate", "CLIENT")
    assert generation["start_ns"] < prefill_call["end_ns"] <= generate_call["start_ns"]
    assert generation["end_ns"] <= generate_call["end_ns"]


def test_every_span_names_the_request_and_genai_attributes(chat: dict[str, Any]) -> None:
    spans = _request_spans(chat)
    request_ids = {s["attributes"].get("pdserve.request_id") for s in spans}
    assert len(request_ids) == 1 and None not in request_ids
    attributes = _one(spans, "gateway.request")["attributes"]
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.model"] == attributes["gen_ai.response.model"] == "demo"
    assert attributes["gen_ai.request.max_tokens"] == 8
    assert attributes["gen_ai.usage.output_tokens"] == 8
    assert attributes["gen_ai.response.finish_reasons"] == ["length"]


def test_the_request_and_prefill_spans_say_where_the_first_token_time_went(
    chat: dict[str, Any],
) -> None:
    spans = _request_spans(chat)
    request = _one(spans, "gateway.request")["attributes"]
    gateway_phases = ("admission_queue", "gateway_queue", "network", "lease", "prefill_queue",
                      "compute", "first_token_to_client", "transfer_tail")  # fmt: skip
    for phase in gateway_phases:
        assert request[f"pdserve.phase.{phase}_ms"] >= 0, phase
    assert request["pdserve.phase.compute_ms"] > 0
    prefill = _one(spans, "/pdserve.v1.PrefillService/Prefill", "SERVER")["attributes"]
    for phase in ("lease", "queue", "compute", "transfer_tail"):
        assert prefill[f"pdserve.phase.{phase}_ms"] >= 0, phase
    transfer = _one(spans, "prefill.kv_transfer")["attributes"]
    assert (
        request["pdserve.phase.transport"]
        == prefill["pdserve.phase.transport"]
        == transfer["pdserve.transport"]
    )
    # The gateway's prefill phases are the ones the prefill reported (rounded to 1 us).
    assert request["pdserve.phase.compute_ms"] == pytest.approx(
        prefill["pdserve.phase.compute_ms"], abs=0.002
    )


def test_polls_are_traced_only_with_the_flag(chat: dict[str, Any]) -> None:
    # NOTE: this gateway runs with trace_polls; without it (the default) polls make no trace,
    # which the process test checks.
    polls = [s for s in chat["spans"] if s["name"].startswith("GET ")]
    assert sorted(s["name"] for s in polls) == sorted(f"GET {path}" for path in POLLS)
    assert len({s["trace_id"] for s in polls}) == len(POLLS)
    assert INCOMING_TRACE_ID not in {s["trace_id"] for s in polls}


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
    generations = [s for s in spans if s["name"] == "decode.generation"
                   and s["trace_id"] == root["trace_id"]]  # fmt: skip
    preempted = [g for g in generations if g["attributes"]["pdserve.lease_state"] == "PREEMPTED"]
    assert preempted and all("preemption" in g["events"] for g in preempted)
