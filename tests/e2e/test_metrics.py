"""Prometheus /metrics on every service, read with prometheus-client's own parser."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.real_cluster import MODEL_NAME, RealCluster

NUM_REQUESTS = 5


def _samples(text: str) -> dict[str, float]:
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels or (set(sample.labels) <= {"le"} and sample.labels.get("le") == "+Inf")
    }


def _by_label(text: str, name: str, label: str) -> dict[str, float]:
    """The samples named `name`, by the value of their `label`."""
    return {
        sample.labels[label]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and label in sample.labels
    }


@pytest.fixture
async def cluster(demo_model_dir: Path) -> AsyncIterator[RealCluster]:
    real = RealCluster(demo_model_dir)
    try:
        yield await real.start()
    finally:
        await real.close()


async def test_metrics_after_n_requests(cluster: RealCluster) -> None:
    async with cluster.http() as http:
        for i in range(NUM_REQUESTS):
            body = {
                "model": MODEL_NAME,
                "prompt": f"count {i}",
                "max_tokens": 6,
                "stream": i % 2 == 0,
            }
            (await http.post("/v1/completions", json=body)).raise_for_status()
        gateway = _samples((await http.get("/metrics")).text)
    assert gateway["pdserve_gateway_time_to_first_token_seconds_count"] == NUM_REQUESTS
    assert gateway["pdserve_gateway_request_duration_seconds_count"] == NUM_REQUESTS
    assert gateway["pdserve_gateway_inter_token_latency_seconds_count"] == NUM_REQUESTS * 5

    await cluster.assert_whole()
    prefill_address = cluster.prefills[0].status.instance.metrics_address
    decode_address = cluster.decodes[0].status.instance.metrics_address
    async with httpx.AsyncClient(timeout=10) as client:
        prefill_text = (await client.get(f"http://{prefill_address}/metrics")).text
        prefill = _samples(prefill_text)
        decode = _samples((await client.get(f"http://{decode_address}/metrics")).text)
    assert prefill["pdserve_prefill_handed_off_total"] == NUM_REQUESTS
    assert prefill["pdserve_prefill_prompt_tokens_total"] > 0
    transfers = _by_label(prefill_text, "pdserve_prefill_kv_transfer_seconds_count", "transport")
    assert sum(transfers.values()) == NUM_REQUESTS
    assert set(transfers) <= {"nixl", "shm", "tcp", "grpc"}
    assert (
        prefill["pdserve_prefill_kv_sent_bytes_total"]
        == decode["pdserve_decode_kv_received_bytes_total"]
    )
    assert decode["pdserve_decode_leases_granted_total"] == NUM_REQUESTS
    assert decode["pdserve_decode_generated_tokens_total"] == NUM_REQUESTS * 5  # first is prefill's
    assert decode["pdserve_decode_free_blocks"] == decode["pdserve_decode_total_blocks"] > 0
    assert decode["pdserve_decode_preemptions_total"] == 0
    assert prefill["pdserve_prefill_free_blocks"] == prefill["pdserve_prefill_total_blocks"]


TTFT_PHASES = (
    "admission_queue",
    "gateway_queue",
    "network",
    "lease",
    "prefill_queue",
    "compute",
    "first_token_to_client",
    "transfer_tail",
)


async def test_one_request_shows_where_its_time_to_first_token_went(cluster: RealCluster) -> None:
    async with cluster.http() as http:
        body = {"model": MODEL_NAME, "prompt": "where did the time go", "max_tokens": 4}
        (await http.post("/v1/completions", json={**body, "stream": True})).raise_for_status()
        families = text_string_to_metric_families((await http.get("/metrics")).text)
    phases = {
        sample.labels["phase"]: sample.value
        for family in families
        if family.name == "pdserve_gateway_ttft_phase_seconds"
        for sample in family.samples
        if sample.name.endswith("_count")
    }
    assert phases == dict.fromkeys(TTFT_PHASES, 1.0)
    prefill_address = cluster.prefills[0].status.instance.metrics_address
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(f"http://{prefill_address}/metrics")).text
    prefill = {
        (sample.name, sample.labels.get("phase")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    for phase in ("lease", "queue", "compute", "transfer_tail"):
        assert prefill[("pdserve_prefill_phase_seconds_count", phase)] == 1
    assert prefill[("pdserve_prefill_phase_seconds_sum", "compute")] > 0
