"""`pdserve-prefill` as a real process: starts, answers health, registers, drains on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.pki import cluster_pki

from pdserve.common.authz import AuthorizationInterceptor
from pdserve.common.grpc_server import new_aio_server
from pdserve.prefill.__main__ import build_parser, main
from pdserve.prefill.config import PrefillConfig
from pdserve.v1 import common_pb2, registry_pb2, registry_pb2_grpc


class _Registry(registry_pb2_grpc.RegistryServiceServicer):
    def __init__(self) -> None:
        self.registered: list[common_pb2.InstanceInfo] = []
        self.loads: list[common_pb2.LoadReport] = []
        self.deregistered: list[str] = []

    async def Register(self, request, context):  # type: ignore[no-untyped-def]
        self.registered.append(request.instance)
        self.loads.append(request.load)
        return registry_pb2.RegisterResponse(heartbeat_interval_ms=100)

    async def Heartbeat(self, request, context):  # type: ignore[no-untyped-def]
        self.loads.append(request.load)
        return registry_pb2.HeartbeatResponse()

    async def Deregister(self, request, context):  # type: ignore[no-untyped-def]
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
    for flag in (
        "--model",
        "--num-blocks",
        "--block-size",
        "--max-num-batched-tokens",
        "--prepare-concurrency",
        "--allocate-timeout-ms",
        "--max-chunk-bytes",
        "--gateway",
        "--advertise-address",
    ):
        assert flag in text
    assert "layer by layer" in text


def test_a_prefill_captures_no_decode_graphs() -> None:
    assert build_parser().parse_args(["--enforce-eager"]).enforce_eager
    assert not PrefillConfig(insecure=True).runs_decode_steps


def test_bad_settings_exit_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--insecure", "--max-num-batched-tokens", "0"]) == 2
    assert "max_num_batched_tokens must be positive" in capsys.readouterr().err


def test_the_kv_cache_is_sized_from_free_memory_unless_told(
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = PrefillConfig(insecure=True)
    assert config.num_blocks is None and config.kv_cache_memory_mb is None
    assert config.kv_cache_memory_fraction is None
    assert config.kv_cache_max_seqs == config.max_queue_len
    assert not config.kv_cache_in_shm
    assert main(["--insecure", "--kv-cache-memory-fraction", "1.5"]) == 2
    assert "kv_cache_memory_fraction must be in (0, 1]" in capsys.readouterr().err


async def test_process_serves_health_registers_and_drains(tiny_model_dir: Path) -> None:
    # NOTE: mutual TLS end to end: the process registers with a gateway certificate's server
    # and serves health to an operator's client certificate.
    registry = _Registry()
    server = new_aio_server([AuthorizationInterceptor()])
    registry_pb2_grpc.add_RegistryServiceServicer_to_server(registry, server)
    gateway_port = cluster_pki().security("gateway", "gateway-cli").bind(server, "127.0.0.1:0")
    await server.start()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "pdserve.prefill",
        "--model",
        str(tiny_model_dir),
        "--port",
        "0",
        "--num-blocks",
        "32",
        "--gateway",
        f"127.0.0.1:{gateway_port}",
        *cluster_pki().args("prefill", "prefill-cli"),
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stderr is not None
        started = await _log_event(process.stderr, "prefill_started", 60)
        assert started["instance_id"] == "prefill-cli"
        assert started["internal_plane"] == "mtls prefill/prefill-cli"
        channel = cluster_pki().channel(started["address"])
        health = health_pb2_grpc.HealthStub(channel)
        check = health_pb2.HealthCheckRequest(service="pdserve.v1.PrefillService")
        reply = await health.Check(check)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        await _log_event(process.stderr, "registered", 10)
        instance = registry.registered[0]
        assert instance.role == common_pb2.INSTANCE_ROLE_PREFILL
        assert instance.address == started["address"]
        assert len(instance.kv_layout.fingerprint) == 64
        assert registry.loads[0].num_total_blocks == 32
        await channel.close()

        process.send_signal(signal.SIGTERM)
        await _log_event(process.stderr, "prefill_stopped", 30)
        assert await asyncio.wait_for(process.wait(), 30) == 0
        assert registry.deregistered == [instance.instance_id]
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await server.stop(grace=None)
