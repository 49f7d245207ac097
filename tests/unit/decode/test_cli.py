"""`pdserve-decode` as a real process: starts, answers health, registers, drains on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.common.grpc_server import new_aio_server
from pdserve.decode.__main__ import build_parser
from pdserve.v1 import common_pb2, registry_pb2, registry_pb2_grpc


class _Registry(registry_pb2_grpc.RegistryServiceServicer):
    def __init__(self) -> None:
        self.registered: list[common_pb2.InstanceInfo] = []
        self.deregistered: list[str] = []

    async def Register(self, request, context):
        self.registered.append(request.instance)
        return registry_pb2.RegisterResponse(heartbeat_interval_ms=100)

    async def Heartbeat(self, request, context):
        return registry_pb2.HeartbeatResponse()

    async def Deregister(self, request, context):
        self.deregistered.append(request.instance_id)
        return registry_pb2.DeregisterResponse()


async def _log_event(stream: asyncio.StreamReader, event: str, timeout_s: float) -> dict:
    async def scan() -> dict:
        while line := await stream.readline():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("event") == event:
                return record
        raise AssertionError(f"process ended before logging {event}")

    return await asyncio.wait_for(scan(), timeout_s)


def test_help_explains_the_flags() -> None:
    text = build_parser().format_help()
    for flag in ("--num-blocks", "--reserve-tokens", "--lease-ttl-ms", "--gateway", "--model"):
        assert flag in text


async def test_process_serves_health_registers_and_drains(tiny_model_dir: Path) -> None:
    registry = _Registry()
    server = new_aio_server()
    registry_pb2_grpc.add_RegistryServiceServicer_to_server(registry, server)
    gateway_port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "pdserve.decode",
        "--model",
        str(tiny_model_dir),
        "--port",
        "0",
        "--num-blocks",
        "32",
        "--gateway",
        f"127.0.0.1:{gateway_port}",
        "--insecure",
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stderr is not None
        warning = await _log_event(process.stderr, "internal_plane_insecure", 60)
        assert warning["level"] == "warning"
        started = await _log_event(process.stderr, "decode_started", 60)
        assert started["internal_plane"] == "insecure"
        channel = grpc.aio.insecure_channel(started["address"])
        health = health_pb2_grpc.HealthStub(channel)
        check = health_pb2.HealthCheckRequest(service="pdserve.v1.DecodeService")
        reply = await health.Check(check)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        await _log_event(process.stderr, "registered", 10)
        instance = registry.registered[0]
        assert instance.role == common_pb2.INSTANCE_ROLE_DECODE
        assert instance.address == started["address"]
        assert len(instance.kv_layout.fingerprint) == 64
        await channel.close()

        process.send_signal(signal.SIGTERM)
        await _log_event(process.stderr, "decode_stopped", 30)
        assert await asyncio.wait_for(process.wait(), 30) == 0
        assert registry.deregistered == [instance.instance_id]
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await server.stop(grace=None)


def test_a_bad_kv_store_spec_is_refused_at_start(capsys) -> None:
    from pdserve.decode.__main__ import main

    assert main(["--insecure", "--kv-store", "s3://bucket"]) == 2
    error = capsys.readouterr().err
    assert "kv_store" in error and "file:DIR" in error and "redis://HOST:PORT" in error
