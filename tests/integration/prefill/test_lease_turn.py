"""A request takes its decode lease at its turn: behind a busy engine it waits without one."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support.eventually import eventually
from support.held_runner import HeldRunner
from support.prefill_cluster import Cluster, cluster

from pdserve.common import telemetry
from pdserve.common.generation import SamplingParams
from pdserve.engine.colocated import LLMEngine
from pdserve.prefill.request import RequestStatus

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 300 + 3 for j in range(17)] for i in range(4)]


def _num_granted(pd: Cluster) -> int:
    return pd.decodes[0].leases.num_granted


def _is_computing_first(pd: Cluster) -> bool:
    flight = pd.prefill.handoffs.live.get("turn-0")
    return flight is not None and flight.request.status is RequestStatus.PREFILLING


async def _hold_and_send(pd: Cluster, gate: threading.Event) -> list[asyncio.Task[list[int]]]:
    pd.prefill.loop.runner = HeldRunner(pd.prefill.loop.runner, gate)  # type: ignore[assignment]
    first = asyncio.create_task(pd.complete("turn-0", PROMPTS[0], GREEDY))
    await eventually(lambda: _is_computing_first(pd), what="the first request computing")
    rest = [
        asyncio.create_task(pd.complete(f"turn-{i}", prompt, GREEDY))
        for i, prompt in enumerate(PROMPTS[1:], start=1)
    ]
    return [first, *rest]


async def test_requests_behind_a_busy_engine_wait_for_their_turn_without_a_lease(
    tiny_model_dir: Path, engine: LLMEngine, spans: InMemorySpanExporter
) -> None:
    gate = threading.Event()
    # One 17-token prompt at a time may hold a lease: 17 + 17 > 20.
    async with cluster(tiny_model_dir, lease_window_tokens=20) as pd:
        try:
            tasks = await _hold_and_send(pd, gate)
            window = pd.prefill.handoffs.window
            await eventually(lambda: window.num_waiting == 3, what="three requests in line")
            assert _num_granted(pd) == 1
            assert (await pd.decode_pool()).pool.num_open_leases == 1
            load = (await pd.prefill_pool()).load
            assert (load.num_queued_requests, load.num_running_requests) == (3, 1)
        finally:
            gate.set()
        results = await asyncio.gather(*tasks)
        assert results == [engine.generate([p], GREEDY)[0] for p in PROMPTS]
        assert _num_granted(pd) == 4 and window.num_waited == 3
        assert window.num_tokens == 0 and window.num_waiting == 0
        await pd.assert_whole()
    turns = [s for s in spans.get_finished_spans() if s.name == "prefill.lease_turn"]
    waited = sorted(str(dict(s.attributes or {})[telemetry.REQUEST_ID]) for s in turns)
    assert waited == ["turn-1", "turn-2", "turn-3"]  # the first did not wait: no span


@pytest.mark.parametrize("lease_window_tokens", [0, 1_000])
async def test_a_wide_or_no_window_leases_every_request_on_arrival(
    tiny_model_dir: Path, engine: LLMEngine, lease_window_tokens: int
) -> None:
    gate = threading.Event()
    async with cluster(tiny_model_dir, lease_window_tokens=lease_window_tokens) as pd:
        try:
            tasks = await _hold_and_send(pd, gate)
            await eventually(lambda: _num_granted(pd) == 4, what="every request leased")
            assert pd.prefill.handoffs.window.num_waited == 0
        finally:
            gate.set()
        results = await asyncio.gather(*tasks)
        assert results == [engine.generate([p], GREEDY)[0] for p in PROMPTS]
        await pd.assert_whole()
