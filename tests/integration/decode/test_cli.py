"""`pdserve-decode` as a real process: starts, answers health, registers, drains on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.pki import cluster_pki

from pdserve.common.grpc_server import new_aio_server
from pdserve.decode.__main__ import build_parser
from pdserve.decode.config import DecodeConfig
from pdserve.v1 import (
    common_pb2,
    instance_pb2,
    instance_pb2_grpc,
    registry_pb2,
    registry_pb2_grpc,
)


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


def test_precision_flags_default_to_auto() -> None:
    args = build_parser().parse_args(["--quantization", "int4"])
    assert (args.dtype, args.quantization) == ("auto", "int4")
    assert (DecodeConfig(insecure=True).dtype, DecodeConfig(insecure=True).quantization) == (
        "auto",
        "auto",
    )
    with pytest.raises(ValueError, match="quantization"):
        DecodeConfig(insecure=True, quantization="int2")


def test_enforce_eager_turns_decode_graphs_off() -> None:
    assert not build_parser().parse_args([]).enforce_eager
    assert build_parser().parse_args(["--enforce-eager"]).enforce_eager
    config = DecodeConfig(insecure=True)
    assert config.runs_decode_steps and not config.enforce_eager


def test_the_kv_cache_is_sized_from_free_memory_unless_told() -> None:
    config = DecodeConfig(insecure=True)
    assert config.num_blocks is None and config.kv_cache_memory_mb is None
    assert config.kv_cache_max_seqs == config.max_num_seqs
    assert config.kv_cache_in_shm
    assert not DecodeConfig(insecure=True, kv_transports="tcp").kv_cache_in_shm
    assert not DecodeConfig(insecure=True, device="cuda:0").kv_cache_in_shm
    for bad in ({"kv_cache_memory_fraction": 0.0}, {"kv_cache_memory_mb": 0}):
        with pytest.raises(ValueError):
            DecodeConfig(insecure=True, **bad)  # type: ignore[arg-type]


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


async def test_the_health_port_answers_probes_without_a_certificate(tiny_model_dir: Path) -> None:
    """Under mutual TLS, --health-port serves grpc.health.v1 in plaintext and nothing else;
    it says NOT_SERVING once the instance drains."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdserve.decode", "--model", str(tiny_model_dir),
        "--port", "0", "--health-port", "0", "--num-blocks", "32", *cluster_pki().args("decode"),
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert process.stderr is not None
        health_port = (await _log_event(process.stderr, "health_port_started", 60))["port"]
        started = await _log_event(process.stderr, "decode_started", 60)
        assert started["internal_plane"] != "insecure"
        probe = grpc.aio.insecure_channel(f"127.0.0.1:{health_port}")
        health = health_pb2_grpc.HealthStub(probe)
        check = health_pb2.HealthCheckRequest(service="pdserve.v1.DecodeService")
        assert (await health.Check(check)).status == health_pb2.HealthCheckResponse.SERVING
        # Nothing but health on the plaintext port; the service port still wants a certificate.
        status = instance_pb2_grpc.InstanceServiceStub(probe).GetInstanceStatus
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await status(instance_pb2.GetInstanceStatusRequest())
        assert refused.value.code() is grpc.StatusCode.UNIMPLEMENTED
        async with grpc.aio.insecure_channel(started["address"]) as plaintext:
            with pytest.raises(grpc.aio.AioRpcError) as no_handshake:
                await health_pb2_grpc.HealthStub(plaintext).Check(check, timeout=5)
            assert no_handshake.value.code() is grpc.StatusCode.UNAVAILABLE

        watch = health.Watch(check)
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        process.send_signal(signal.SIGTERM)
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        await probe.close()
        assert await asyncio.wait_for(process.wait(), 30) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


def test_a_bad_kv_store_spec_is_refused_at_start(capsys) -> None:
    from pdserve.decode.__main__ import main

    assert main(["--insecure", "--kv-store", "s3://bucket"]) == 2
    error = capsys.readouterr().err
    assert "kv_store" in error and "file:DIR" in error and "redis://HOST:PORT" in error


async def test_an_unsupported_model_is_refused_by_name_and_never_registers(
    tmp_path: Path,
) -> None:
    config = {
        "model_type": "gpt_neox",
        "vocab_size": 64,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    registry = _Registry()
    server = new_aio_server()
    registry_pb2_grpc.add_RegistryServiceServicer_to_server(registry, server)
    gateway_port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        process = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "pdserve.decode", "--model", str(tmp_path), "--port", "0"),
            *("--gateway", f"127.0.0.1:{gateway_port}", "--insecure"),
            stderr=asyncio.subprocess.PIPE,
        )
        _, stderr = await asyncio.wait_for(process.communicate(), 60)
    finally:
        await server.stop(grace=None)
    assert process.returncode == 2
    text = stderr.decode()
    assert "Traceback" not in text
    refused = [json.loads(line) for line in text.splitlines() if '"model_refused"' in line]
    assert refused and "'gpt_neox'" in refused[0]["reason"]
    assert "qwen3_moe" in refused[0]["reason"] and "gemma3_text" in refused[0]["reason"]
    assert '"decode_started"' not in text and not registry.registered


@pytest.mark.parametrize("flag", ["--port", "--kv-tcp-port"])
def test_a_taken_port_fails_the_start_in_one_line(tiny_model_dir: Path, flag: str) -> None:
    """Another process on one of its ports (a decode still running there, say): exit 1
    naming the address, no traceback, never registered."""
    ports = {"--port": "0", "--kv-tcp-port": "0", "--metrics-port": "0"}
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        ports[flag] = str(port)
        result = subprocess.run(
            [sys.executable, "-m", "pdserve.decode", "--model", str(tiny_model_dir),
             "--insecure", "--host", "127.0.0.1", "--gateway", "127.0.0.1:1",
             "--kv-transports", "tcp", *[arg for pair in ports.items() for arg in pair]],
            capture_output=True,
            text=True,
            timeout=120,
        )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1].startswith(
        f"pdserve-decode: cannot listen on 127.0.0.1:{port}: "
    ), result.stderr
    assert '"registered"' not in result.stderr


# NOTE: a supervisor as `pdserve up`'s launcher is one: it starts the decode with
# `ChildProcess` (reading its stderr into the log file), says its pid once it started, then
# lives until the test kills it outright.
_SUPERVISOR = """
import sys
from pathlib import Path
from pdserve.launcher.child import ChildProcess
child = ChildProcess("decode", sys.argv[2:], Path(sys.argv[1]))
child.wait_for_event("decode_started", 120)
print(child.pid, flush=True)
sys.stdin.read()
"""
# NOTE: bounds only a run that goes wrong: the decode drains an idle instance at once.
SUPERVISOR_GONE_WAIT_S = 120


def test_a_decode_whose_supervisor_is_killed_drains_stops_and_says_so_in_its_log(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    log_path = tmp_path / "decode.log"
    argv = [sys.executable, "-m", "pdserve.decode", "--model", str(tiny_model_dir),
            "--port", "0", "--num-blocks", "32", "--insecure"]  # fmt: skip
    supervisor = subprocess.Popen(
        [sys.executable, "-c", _SUPERVISOR, str(log_path), *argv],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    decode_pid = None
    try:
        assert supervisor.stdout is not None
        decode_pid = int(supervisor.stdout.readline())
        # NOTE: it offers the shm transport: its cache lives in a segment named for its pid.
        segments = f"pdserve-kv-{decode_pid}-*"
        assert list(Path("/dev/shm").glob(segments))
        exited = os.pidfd_open(decode_pid)
        supervisor.kill()
        supervisor.wait()
        ready, _, _ = select.select([exited], [], [], SUPERVISOR_GONE_WAIT_S)
        os.close(exited)
        assert ready, f"the decode still runs {SUPERVISOR_GONE_WAIT_S} s after its supervisor"
        decode_pid = None
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()
        if decode_pid is not None:
            os.kill(decode_pid, signal.SIGKILL)
    events = [json.loads(line)["event"] for line in log_path.read_text().splitlines()
              if line.startswith("{")]  # fmt: skip
    # NOTE: the lines after the supervisor's death went on into the same file (its stdout).
    assert events.index("supervisor_gone") < events.index("decode_stopped"), events[-8:]
    assert not list(Path("/dev/shm").glob(segments))
