"""Several gateways over one set of instances, shared through etcd, as `pdserve up --gateways 2
--registry etcd://...` starts them: separate processes, mutual TLS, a real etcd.

Short TTLs keep these fast: instances hold a 2 s etcd lease (etcd's smallest with default
settings) refreshed every 0.3 s, and gateways drop an instance silent for 3 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from support.etcd_server import EtcdServer
from support.eventually import eventually
from support.process_cluster import ProcessCluster, events_named, running_cluster_on_etcd

from pdserve.common.grpc_server import insecure_channel
from pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

INSTANCE_ARGS = "--num-blocks 256 --registry-ttl-s 2 --heartbeat-interval-s 0.3"
GATEWAY_ARGS = "--instance-ttl-s 3 --heartbeat-interval-s 0.3"
PROMPT = "The registry is shared"


@contextlib.contextmanager
def gateways_over_etcd(
    demo_model_dir: Path, tmp_path: Path
) -> Iterator[tuple[ProcessCluster, EtcdServer]]:
    """Two gateways, a prefill and two decodes, registered in a real etcd."""
    with running_cluster_on_etcd(
        demo_model_dir,
        tmp_path,
        gateways=2,
        decodes=2,
        prefill_args=INSTANCE_ARGS,
        decode_args=INSTANCE_ARGS,
        gateway_args=GATEWAY_ARGS,
    ) as pair:
        yield pair


@pytest.fixture(scope="module")
def shared(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ProcessCluster, EtcdServer]]:
    """For the cases that kill no process (etcd restarted comes back whole)."""
    with gateways_over_etcd(demo_model_dir, tmp_path_factory.mktemp("etcd-gateways")) as pair:
        yield pair


@pytest.fixture
def cluster(demo_model_dir: Path, tmp_path: Path) -> Iterator[ProcessCluster]:
    """For a case that kills a process."""
    with gateways_over_etcd(demo_model_dir, tmp_path) as (started, _):
        yield started


def _request(model: str, max_tokens: int) -> generation_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return generation_pb2.GenerateRequest(model=model, text=PROMPT, sampling=sampling)


async def _generate(address: str, model: str, max_tokens: int = 8) -> list[int]:
    """One request over GenerationService; its token ids."""
    async with insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        ids: list[int] = []
        async for response in stub.Generate(_request(model, max_tokens), timeout=30):
            ids.extend(response.token_ids)
        return ids


async def _num_instances(address: str) -> tuple[int, int]:
    """(prefills, decodes) a gateway routes to (ListModels: 0, 0 without a pair)."""
    async with insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        listed = await stub.ListModels(generation_pb2.ListModelsRequest(), timeout=5)
    if not listed.models:
        return 0, 0
    return listed.models[0].num_prefill_instances, listed.models[0].num_decode_instances


async def _all_see(cluster: ProcessCluster, expected: tuple[int, int]) -> bool:
    counts = [await _num_instances(a) for a in cluster.grpc_addresses]
    return all(count == expected for count in counts)


async def test_both_gateways_serve_the_same_instances(
    shared: tuple[ProcessCluster, EtcdServer],
) -> None:
    cluster, _ = shared
    await eventually(lambda: _all_see(cluster, (1, 2)), 30, "both gateways see 1 + 2")
    outputs = [await _generate(a, cluster.model_name) for a in cluster.grpc_addresses]
    assert len(outputs[0]) == 8
    assert outputs[0] == outputs[1]
    async with httpx.AsyncClient(timeout=30) as http:
        for url in cluster.rest_urls:
            response = await http.post(
                f"{url}/v1/completions",
                json={"model": cluster.model_name, "prompt": PROMPT, "max_tokens": 4},
            )
            assert response.status_code == 200, response.text


async def test_a_killed_instance_leaves_both_gateways(cluster: ProcessCluster) -> None:
    await eventually(lambda: _all_see(cluster, (1, 2)), 30, "both gateways see 1 + 2")
    victim = cluster.decodes[1]
    victim.signal(signal.SIGKILL)
    assert victim.wait(10) == -signal.SIGKILL
    # NOTE: the lease is 2 s and the gateways' own TTL 3 s; either removes it.
    await eventually(lambda: _all_see(cluster, (1, 1)), 30, "the decode gone from both")
    for address in cluster.grpc_addresses:
        assert len(await _generate(address, cluster.model_name)) == 8


async def test_requests_keep_succeeding_while_etcd_restarts(
    shared: tuple[ProcessCluster, EtcdServer],
) -> None:
    cluster, etcd = shared
    await eventually(lambda: _all_see(cluster, (1, 2)), 30, "both gateways see 1 + 2")
    expected = await _generate(cluster.grpc_addresses[0], cluster.model_name)
    outputs: list[list[int]] = []
    stop = asyncio.Event()

    async def keep_asking() -> None:
        while not stop.is_set():
            for address in cluster.grpc_addresses:
                outputs.append(await _generate(address, cluster.model_name))

    asking = asyncio.create_task(keep_asking())
    try:
        await asyncio.to_thread(etcd.stop)
        num_before = len(outputs)
        await asyncio.sleep(4.0)  # longer than the lease and the gateways' TTL
        assert len(outputs) > num_before, "no request finished while etcd was down"
        assert await _all_see(cluster, (1, 2)), "a gateway dropped instances while etcd was down"
        await asyncio.to_thread(etcd.start)

        def refreshed() -> bool:
            return all(events_named(c, "registration_restored") for c in cluster.instances) and all(
                len(events_named(g, "registry_watching")) >= 2 for g in cluster.gateways
            )

        await eventually(refreshed, 30, "instances and gateways back on etcd")
        num_after = len(outputs)
        await eventually(lambda: len(outputs) > num_after + 2, 30, "requests after the restart")
        stop.set()
        await asyncio.wait_for(asking, 30)
    finally:
        asking.cancel()
    assert all(ids == expected for ids in outputs)
    assert await _all_see(cluster, (1, 2))


async def _sse_until_cut(url: str, model: str, max_tokens: int, streaming: asyncio.Event) -> int:
    """Streams a REST completion and sets `streaming` at its first event; returns how many
    events came before the connection broke (fails if the stream ends normally)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    num_events = 0
    async with httpx.AsyncClient(timeout=60) as http:
        with pytest.raises(httpx.TransportError):
            async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    assert line != "data: [DONE]", "the stream ended normally"
                    if line.startswith("data: "):
                        num_events += 1
                        streaming.set()
    return num_events


async def test_a_killed_gateway_fails_only_its_streams_retryably(cluster: ProcessCluster) -> None:
    await eventually(lambda: _all_see(cluster, (1, 2)), 30, "both gateways see 1 + 2")
    doomed, survivor = cluster.gateways[0], cluster.grpc_addresses[1]
    max_tokens = 1500
    rest_streaming = asyncio.Event()
    rest = asyncio.create_task(
        _sse_until_cut(cluster.rest_urls[0], cluster.model_name, max_tokens, rest_streaming)
    )
    await asyncio.wait_for(rest_streaming.wait(), 30)
    request = _request(cluster.model_name, max_tokens)
    num_received = 0
    async with insecure_channel(cluster.grpc_addresses[0]) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            async for response in stub.Generate(request, timeout=60):
                num_received += len(response.token_ids)
                if doomed.returncode is None:
                    doomed.signal(signal.SIGKILL)
    assert 0 < num_received < max_tokens
    # NOTE: what a client sees of a dead gateway: gRPC UNAVAILABLE, or a REST stream cut
    # before its [DONE]; both are retryable on another gateway.
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert 0 < await asyncio.wait_for(rest, 30) < max_tokens
    assert doomed.wait(10) == -signal.SIGKILL
    assert len(await _generate(survivor, cluster.model_name, max_tokens)) == max_tokens
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.post(
            f"{cluster.rest_urls[1]}/v1/completions",
            json={"model": cluster.model_name, "prompt": PROMPT, "max_tokens": 4},
        )
    assert response.status_code == 200, response.text
