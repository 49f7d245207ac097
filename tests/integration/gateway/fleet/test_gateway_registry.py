"""The registry and RegistryService: register, heartbeat, TTL drop, re-register, static polling."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
from support.eventually import eventually
from support.gateway_cluster import Cluster, instance_info
from support.gateway_fakes import MODEL_NAME, heartbeat, register

from pdserve.common.errors import ErrorReason, PdserveError, from_rpc_error
from pdserve.common.grpc_server import insecure_channel
from pdserve.gateway.fleet.instance import InstanceRole, LoadReport
from pdserve.gateway.fleet.registry import Registry
from pdserve.v1 import registry_pb2, registry_pb2_grpc


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_register_heartbeat_and_ttl_drop() -> None:
    clock = FakeClock()
    registry = Registry(ttl_s=5.0, clock=clock)
    registry.register(instance_info("d1", InstanceRole.DECODE), LoadReport(num_free_blocks=10))
    clock.now += 4.0
    registry.heartbeat("d1", LoadReport(num_free_blocks=3))
    clock.now += 4.0
    assert registry.drop_expired() == []
    entry = registry.get("d1")
    assert entry is not None and entry.load.num_free_blocks == 3
    assert [e.instance_id for e in registry.alive(InstanceRole.DECODE)] == ["d1"]
    clock.now += 1.5
    assert registry.alive() == []  # past the TTL: not routable even before the sweep
    assert registry.drop_expired() == ["d1"]
    with pytest.raises(PdserveError) as raised:
        registry.heartbeat("d1", LoadReport())
    assert raised.value.reason is ErrorReason.INSTANCE_NOT_REGISTERED


def test_unreachable_until_next_heartbeat() -> None:
    registry = Registry(ttl_s=5.0, clock=FakeClock())
    registry.register(instance_info("p1", InstanceRole.PREFILL), LoadReport())
    registry.mark_unreachable("p1")
    assert registry.alive() == []
    registry.heartbeat("p1", LoadReport())
    assert len(registry.alive()) == 1


def test_draining_until_a_heartbeat_says_it_admits() -> None:
    registry = Registry(ttl_s=5.0, clock=FakeClock())
    registry.register(instance_info("p1", InstanceRole.PREFILL), LoadReport())
    version = registry.version
    registry.mark_draining("p1")
    entry = registry.get("p1")
    assert entry is not None and entry.load.is_draining and registry.version > version
    registry.heartbeat("p1", LoadReport(is_draining=True))  # still going away
    assert entry.load.is_draining
    registry.heartbeat("p1", LoadReport())  # started again under the same id
    assert not entry.load.is_draining


def test_static_instances_are_not_dropped_by_ttl() -> None:
    clock = FakeClock()
    registry = Registry(ttl_s=1.0, clock=clock)
    registry.register(instance_info("p1", InstanceRole.PREFILL), LoadReport(), is_static=True)
    clock.now += 5.0
    assert registry.drop_expired() == []
    assert registry.alive() == []  # known but stale until the next successful poll


def test_lost_listeners_hear_of_each_silence_once() -> None:
    clock = FakeClock()
    registry = Registry(ttl_s=1.0, clock=clock)
    lost: list[str] = []
    registry.add_lost_listener(lambda entry: lost.append(entry.instance_id))
    registry.register(instance_info("d1", InstanceRole.DECODE), LoadReport())
    registry.register(instance_info("d2", InstanceRole.DECODE), LoadReport())
    registry.register(instance_info("p1", InstanceRole.PREFILL), LoadReport(), is_static=True)
    registry.mark_unreachable("d2")  # one failed call is not a loss
    registry.deregister("d2")  # nor is a goodbye
    clock.now += 0.5
    registry.heartbeat("d1", LoadReport())
    assert registry.drop_expired() == [] and lost == []
    clock.now += 0.7
    assert registry.drop_expired() == []
    assert lost == ["p1"]  # static: stale, announced, kept
    clock.now += 0.5
    assert registry.drop_expired() == ["d1"]
    assert registry.drop_expired() == []
    assert lost == ["p1", "d1"]
    # A static instance that answers a poll again can be lost again.
    registry.register(instance_info("p1", InstanceRole.PREFILL), LoadReport(), is_static=True)
    clock.now += 1.5
    registry.drop_expired()
    assert lost == ["p1", "d1", "p1"]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"protocol_version": "2.0"}, ErrorReason.INCOMPATIBLE_PEER),
        ({"protocol_version": ""}, ErrorReason.INCOMPATIBLE_PEER),
        ({"address": ""}, ErrorReason.INVALID_REQUEST),
        ({"model_name": ""}, ErrorReason.INVALID_REQUEST),
    ],
)
def test_register_refuses_bad_instances(change: dict[str, str], reason: ErrorReason) -> None:
    registry = Registry(ttl_s=5.0)
    info = dataclasses.replace(instance_info("x", InstanceRole.DECODE), **change)
    with pytest.raises(PdserveError) as raised:
        registry.register(info, LoadReport())
    assert raised.value.reason is reason
    assert registry.entries() == []


def test_register_refuses_a_forged_fingerprint() -> None:
    info = instance_info("x", InstanceRole.DECODE)
    forged = dataclasses.replace(info, kv_layout=dataclasses.replace(info.kv_layout, block_size=32))
    with pytest.raises(PdserveError) as raised:
        Registry(ttl_s=5.0).register(forged, LoadReport())
    assert raised.value.reason is ErrorReason.INVALID_REQUEST


async def test_registry_service_flow(cluster: Cluster) -> None:
    gateway = await cluster.start_gateway(heartbeat_interval_s=0.2, instance_ttl_s=0.4)
    decode = await cluster.add_decode(is_registered=False)
    response = await register(cluster.internal_address, decode)
    assert (response.heartbeat_interval_ms, response.instance_ttl_ms) == (200, 400)
    assert response.protocol.version.startswith("1.")

    decode.num_total_blocks = 7
    await heartbeat(cluster.internal_address, decode)
    entry = gateway.registry.get(decode.instance_id)
    assert entry is not None and entry.load.num_free_blocks == 7

    # Missing heartbeats: the sweep drops the instance, and the next heartbeat is refused
    # with INSTANCE_NOT_REGISTERED, so the instance registers again.
    await eventually(lambda: gateway.registry.get(decode.instance_id) is None, 30, "the drop")
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await heartbeat(cluster.internal_address, decode)
    error = from_rpc_error(raised.value)
    assert error.reason is ErrorReason.INSTANCE_NOT_REGISTERED
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    await register(cluster.internal_address, decode)
    assert gateway.registry.get(decode.instance_id) is not None


async def test_registry_service_refuses_another_major(cluster: Cluster) -> None:
    gateway = await cluster.start_gateway()
    decode = await cluster.add_decode(is_registered=False)
    decode.protocol_version = "2.0"
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await register(cluster.internal_address, decode)
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert from_rpc_error(raised.value).reason is ErrorReason.INCOMPATIBLE_PEER
    assert gateway.registry.entries() == []


async def test_deregister_is_idempotent(cluster: Cluster) -> None:
    gateway = await cluster.start_gateway()
    await cluster.add_prefill()
    async with insecure_channel(cluster.internal_address) as channel:
        stub = registry_pb2_grpc.RegistryServiceStub(channel)
        for _ in range(2):
            await stub.Deregister(registry_pb2.DeregisterRequest(instance_id="prefill-0"))
    assert gateway.registry.entries() == []


async def test_static_instances_are_polled_and_serve_requests(cluster: Cluster) -> None:
    prefill = await cluster.add_prefill(is_registered=False)
    decode = await cluster.add_decode(is_registered=False)
    gateway = await cluster.start_gateway(
        prefill=(prefill.address,), decode=(decode.address,), poll_interval_s=0.1
    )
    # NOTE: a poll gives each instance 0.5 s to answer; on a busy machine the first one can miss
    # it, and the next poll (0.1 s later) registers it.
    await eventually(
        lambda: {e.instance_id for e in gateway.registry.alive()} == {"prefill-0", "decode-0"}
    )
    assert all(e.is_static for e in gateway.registry.entries())
    result = await cluster.openai().completions.create(model=MODEL_NAME, prompt="hi", max_tokens=3)
    assert result.usage is not None and result.usage.completion_tokens == 3

    await decode.stop()
    decode.server = None
    await eventually(
        lambda: not any(e.info.role is InstanceRole.DECODE for e in gateway.registry.alive())
    )
    assert [e.instance_id for e in gateway.registry.alive()] == ["prefill-0"]
