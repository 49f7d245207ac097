"""RegistrationClient against a real RegistryService server (a small in-test registry)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from pdserve.common.errors import ErrorReason, PdserveError, abort_with_error
from pdserve.common.grpc_server import new_aio_server
from pdserve.common.registration import RegistrationClient
from pdserve.v1 import common_pb2, registry_pb2, registry_pb2_grpc


class _Registry(registry_pb2_grpc.RegistryServiceServicer):
    def __init__(self) -> None:
        self.instances: dict[str, common_pb2.InstanceInfo] = {}
        self.heartbeats: list[registry_pb2.HeartbeatRequest] = []
        self.num_registers = 0
        self.deregistered: list[str] = []
        self.answer_register = asyncio.Event()  # cleared: a Register is counted, then held
        self.answer_register.set()
        self.num_heartbeats_to_fail = 0  # answered UNAVAILABLE (a gateway that stalled)

    async def Register(self, request, context):
        self.num_registers += 1
        self.instances[request.instance.instance_id] = request.instance
        await self.answer_register.wait()
        return registry_pb2.RegisterResponse(heartbeat_interval_ms=50, instance_ttl_ms=500)

    async def Heartbeat(self, request, context):
        if request.instance_id not in self.instances:
            await abort_with_error(
                context, PdserveError(ErrorReason.INSTANCE_NOT_REGISTERED, "unknown instance")
            )
        if self.num_heartbeats_to_fail > 0:
            self.num_heartbeats_to_fail -= 1
            await abort_with_error(context, PdserveError(ErrorReason.PEER_UNAVAILABLE, "stalled"))
        self.heartbeats.append(request)
        return registry_pb2.HeartbeatResponse(heartbeat_interval_ms=50)

    async def Deregister(self, request, context):
        self.deregistered.append(request.instance_id)
        self.instances.pop(request.instance_id, None)
        return registry_pb2.DeregisterResponse()


@pytest.fixture
async def registry() -> AsyncIterator[tuple[_Registry, str]]:
    servicer = _Registry()
    server = new_aio_server()
    registry_pb2_grpc.add_RegistryServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield servicer, f"127.0.0.1:{port}"
    await server.stop(grace=None)


async def _until(predicate, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_registers_heartbeats_reregisters_and_deregisters(
    registry: tuple[_Registry, str],
) -> None:
    servicer, address = registry
    load = common_pb2.LoadReport(num_free_blocks=7, num_total_blocks=9)
    instance = common_pb2.InstanceInfo(instance_id="d1", role=common_pb2.INSTANCE_ROLE_DECODE)
    client = RegistrationClient(address, instance, lambda: load)
    task = asyncio.create_task(client.run())
    await _until(lambda: len(servicer.heartbeats) >= 2)
    assert servicer.heartbeats[-1].load.num_free_blocks == 7
    assert client.interval_s == pytest.approx(0.05)

    servicer.instances.clear()  # the gateway forgets the instance (e.g. it restarted)
    await _until(lambda: servicer.num_registers >= 2)
    assert "d1" in servicer.instances

    await client.stop()
    await asyncio.wait_for(task, 30)
    assert servicer.deregistered == ["d1"]


async def test_one_failed_heartbeat_is_sent_again_without_registering_again(
    registry: tuple[_Registry, str],
) -> None:
    servicer, address = registry
    instance = common_pb2.InstanceInfo(instance_id="d4", role=common_pb2.INSTANCE_ROLE_DECODE)
    client = RegistrationClient(address, instance, common_pb2.LoadReport)
    task = asyncio.create_task(client.run())
    await _until(lambda: len(servicer.heartbeats) >= 1)
    servicer.num_heartbeats_to_fail = 1
    await _until(lambda: servicer.num_heartbeats_to_fail == 0 and len(servicer.heartbeats) >= 3)
    assert servicer.num_registers == 1 and client.is_registered.is_set()

    servicer.num_heartbeats_to_fail = 2  # still failing when sent again: it registers again
    await _until(lambda: servicer.num_registers == 2)
    await client.stop()
    await asyncio.wait_for(task, 30)


async def test_keeps_retrying_while_the_gateway_is_down() -> None:
    instance = common_pb2.InstanceInfo(instance_id="d2")
    client = RegistrationClient("127.0.0.1:1", instance, common_pb2.LoadReport)
    client.interval_s = 0.01
    task = asyncio.create_task(client.run())
    await asyncio.sleep(0.3)
    assert not task.done()
    assert not client.is_registered.is_set()
    await client.stop()
    await asyncio.wait_for(task, 30)


async def test_stopping_while_a_register_is_under_way_still_deregisters(
    registry: tuple[_Registry, str],
) -> None:
    servicer, address = registry
    servicer.answer_register.clear()
    instance = common_pb2.InstanceInfo(instance_id="d3", role=common_pb2.INSTANCE_ROLE_DECODE)
    client = RegistrationClient(address, instance, common_pb2.LoadReport)
    task = asyncio.create_task(client.run())
    await _until(lambda: servicer.num_registers == 1)  # the gateway counted it; no answer yet
    stopping = asyncio.create_task(client.stop())
    await asyncio.sleep(0)
    assert not stopping.done()  # it waits for the Register's answer
    servicer.answer_register.set()
    await asyncio.wait_for(stopping, 30)
    await asyncio.wait_for(task, 30)
    assert servicer.deregistered == ["d3"] and "d3" not in servicer.instances
