"""The admission queue through REST, in front of fake instances: a request no decode has room
for waits and completes; a client that goes away while queued leaves the queue at once; the
queue's bounds give 429 with Retry-After exactly past them; a gRPC call cancelled while queued
leaves it too. (The queue alone:
test_gateway_capacity_queue; over the orchestrator: test_gateway_orchestrator.)"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
import structlog
from support.eventually import eventually
from support.gateway_cluster import Cluster
from support.gateway_fakes import BLOCK_SIZE, MODEL_NAME, FakeDecode, expected_tokens

from pdserve.common.grpc_server import insecure_channel
from pdserve.gateway.routing.pools import lease_blocks
from pdserve.gateway.routing.queue import CapacityQueue
from pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

PROMPT = "the quick brown fox"
MAX_TOKENS = 12
# NOTE: a decode of this many blocks has room for one request at a time.
ONE_AT_A_TIME = lease_blocks(len(PROMPT.encode()), MAX_TOKENS, BLOCK_SIZE)


def _body(stream: bool = True, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": stream,
            "return_token_ids": True, "seed": 3, **extra}  # fmt: skip


def _queue(cluster: Cluster) -> CapacityQueue:
    assert cluster.gateway is not None
    return cluster.gateway.orchestrator.queue


async def _token_ids(http: httpx.AsyncClient, **extra: Any) -> list[int]:
    """Streams one completion; its token ids."""
    token_ids: list[int] = []
    async with http.stream("POST", "/v1/completions", json=_body(**extra)) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    token_ids += choice.get("token_ids", [])
    return token_ids


async def _hold(cluster: Cluster, decode: FakeDecode, http: httpx.AsyncClient) -> asyncio.Task[Any]:
    """A stream that takes the decode's room and pauses there until `decode.resume` is set."""
    decode.knobs.pause_after = 2
    holder = asyncio.ensure_future(_token_ids(http))
    await asyncio.wait_for(decode.paused.wait(), 30)
    decode.knobs.pause_after = None
    return holder


async def _one_at_a_time(cluster: Cluster, **gateway: Any) -> FakeDecode:
    await cluster.start_gateway(**gateway)
    await cluster.add_prefill()
    return await cluster.add_decode(num_total_blocks=ONE_AT_A_TIME)


async def test_a_request_with_no_room_waits_and_completes(cluster: Cluster) -> None:
    decode = await _one_at_a_time(cluster)
    with structlog.testing.capture_logs() as logs:
        async with cluster.http() as http:
            holder = await _hold(cluster, decode, http)
            waiting = asyncio.ensure_future(_token_ids(http, seed=4))
            await eventually(lambda: _queue(cluster).num_waiting == 1)
            assert decode.allocations and len(decode.allocations) == 1  # it waits at the gateway
            decode.resume.set()
            first, second = await asyncio.gather(holder, waiting)
    # NOTE: its log line says how long it waited for room (the holder's says it did not).
    finished = [entry for entry in logs if entry["event"] == "request_finished"]
    assert len(finished) == 2 and finished[0]["queued_s"] == 0
    assert finished[1]["queued_s"] > 0
    prompt_ids = list(PROMPT.encode())
    assert first == expected_tokens(prompt_ids, 3, MAX_TOKENS)
    assert second == expected_tokens(prompt_ids, 4, MAX_TOKENS)
    assert len(decode.allocations) == 2
    assert _queue(cluster).num_waiting == 0


async def test_a_client_gone_while_queued_leaves_the_queue_at_once(cluster: Cluster) -> None:
    decode = await _one_at_a_time(cluster)
    async with cluster.http() as http:
        holder = await _hold(cluster, decode, http)
        gone = [asyncio.ensure_future(_token_ids(http, stream=stream)) for stream in (True, False)]
        await eventually(lambda: _queue(cluster).num_waiting == 2)
        for client in gone:
            client.cancel()  # NOTE: closes its connection, with no byte of response yet
        await eventually(lambda: _queue(cluster).num_waiting == 0)
        assert _queue(cluster).num_waiting_tokens == 0
        decode.resume.set()
        await holder
    assert len(decode.allocations) == 1  # NOTE: the two never reached an instance


@pytest.mark.parametrize(
    ("bound", "limits"),
    [
        ("max_queued_requests", {"max_queued_requests": 2}),
        ("max_queued_tokens", {"max_queued_tokens": 2 * len(PROMPT.encode())}),
    ],
)
async def test_the_queue_bounds_give_429_with_retry_after_exactly_past_them(
    cluster: Cluster, bound: str, limits: dict[str, int]
) -> None:
    decode = await _one_at_a_time(cluster, **limits)
    async with cluster.http() as http:
        holder = await _hold(cluster, decode, http)
        queued = [asyncio.ensure_future(_token_ids(http, seed=seed)) for seed in (4, 5)]
        await eventually(lambda: _queue(cluster).num_waiting == 2)  # at the bound: both wait
        refused = await http.post("/v1/completions", json=_body())
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        error = refused.json()["error"]
        assert error["code"] == "decode_capacity_exhausted"
        assert bound in error["message"]
        metrics = (await http.get("/metrics")).text
        assert f'pdserve_gateway_queue_refusals_total{{bound="{bound}"}} 1.0' in metrics
        assert "pdserve_gateway_queued_requests 2.0" in metrics
        decode.resume.set()
        await asyncio.gather(holder, *queued)
    assert len(decode.allocations) == 3


async def test_a_grpc_call_cancelled_while_queued_leaves_the_queue_at_once(
    cluster: Cluster,
) -> None:
    decode = await _one_at_a_time(cluster)
    request = generation_pb2.GenerateRequest(
        model=MODEL_NAME, text=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS)
    )
    async with cluster.http() as http, insecure_channel(cluster.grpc_address) as channel:
        holder = await _hold(cluster, decode, http)
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        call = stub.Generate(request)
        waiting = asyncio.ensure_future(anext(aiter(call)))
        await eventually(lambda: _queue(cluster).num_waiting == 1)
        call.cancel()
        await eventually(lambda: _queue(cluster).num_waiting == 0)
        waiting.cancel()
        decode.resume.set()
        await holder
        # NOTE: the gateway serves the next call at once.
        responses = [r async for r in stub.Generate(request)]
    assert responses[-1].usage.num_completion_tokens == MAX_TOKENS
    assert len(decode.allocations) == 2
