"""`pdserve up` as a user runs it: separate processes, the openai SDK, a clean stop."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from support.real_cluster import Reference

from pdserve.common.config import from_args
from pdserve.common.pki import MEMBER_DNS_NAME
from pdserve.common.security import Security
from pdserve.launcher.__main__ import _banner, parse_args
from pdserve.launcher.cluster import Cluster
from pdserve.launcher.config import ClusterConfig
from pdserve.v1 import instance_pb2, instance_pb2_grpc, registry_pb2, registry_pb2_grpc


@pytest.fixture(scope="module")
def cluster(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    config = ClusterConfig(
        model=str(demo_model_dir),
        port=0,
        grpc_port=0,
        internal_port=0,
        log_dir=str(tmp_path_factory.mktemp("logs")),
        startup_timeout_s=120,
        # NOTE: float32 as the reference engine: outputs are compared token for token.
        prefill_args="--dtype float32",
        decode_args="--dtype float32",
    )
    processes = Cluster(config)
    processes.start()
    yield processes
    processes.stop(timeout_s=20)


def test_openai_sdk_against_real_processes(cluster: Cluster, demo_model_dir: Path) -> None:
    reference = Reference(demo_model_dir)
    client = openai.OpenAI(base_url=f"{cluster.rest_url}/v1", api_key="unused", max_retries=0)
    model = next(m.id for m in client.models.list())
    response = client.completions.create(
        model=model, prompt="Hello there", max_tokens=16, temperature=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    expected = reference.completion("Hello there", temperature=0.0, max_tokens=16)
    assert response.choices[0].model_extra["token_ids"] == expected
    messages = [{"role": "user", "content": "Hi"}]
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=12, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == reference.text(reference.chat(messages, temperature=0.0, max_tokens=12))


def test_every_internal_port_refuses_a_caller_without_a_certificate(cluster: Cluster) -> None:
    assert httpx.get(f"{cluster.rest_url}/health").json()["internal_plane"] == "mtls"
    addresses = []
    for child in [*cluster.prefills, *cluster.decodes]:
        role = child.name.split("-")[0]
        started = next(r for r in child.events if r.get("event") == f"{role}_started")
        assert started["internal_plane"] == f"mtls {role}/{child.name}"
        addresses.append(started["address"])
    status = instance_pb2.GetInstanceStatusRequest()
    for address in addresses:
        with grpc.insecure_channel(address) as channel:
            stub = instance_pb2_grpc.InstanceServiceStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.GetInstanceStatus(status, timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    registry = f"{cluster.config.host}:{cluster.internal_port}"
    with grpc.insecure_channel(registry) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            registry_pb2_grpc.RegistryServiceStub(channel).Deregister(
                registry_pb2.DeregisterRequest(instance_id="decode-0"), timeout=5
            )
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    # NOTE: the operator certificate `pdserve up` made is let in (status is a client call).
    assert cluster.tls_dir is not None
    files = cluster.tls["client"]
    operator = Security.from_files(files.ca, files.cert, files.key)

    async def status_as_operator() -> str:
        async with operator.channel(addresses[-1], MEMBER_DNS_NAME) as channel:
            reply = await instance_pb2_grpc.InstanceServiceStub(channel).GetInstanceStatus(status)
            assert not reply.insecure
            return str(reply.instance.instance_id)

    assert asyncio.run(status_as_operator()) == "decode-0"


def test_the_banner_tells_each_instance_kv_capacity(cluster: Cluster) -> None:
    sizes = cluster.kv_cache_sizes()
    assert set(sizes) == {"decode-0", "prefill-0"}
    decode, prefill = sizes["decode-0"], sizes["prefill-0"]
    assert decode["source"] == prefill["source"] == "auto"
    # The demo model serves 2048 tokens: one such sequence per decode slot (64) plus one at
    # most, and at least one; its KV takes 32 KiB per block of 16.
    assert 128 <= decode["num_blocks"] <= 65 * 128
    assert decode["bytes"] == decode["num_blocks"] * 32 * 1024
    assert decode["num_tokens"] == decode["num_blocks"] * 16
    files = cluster.tls["client"]
    operator = Security.from_files(files.ca, files.cert, files.key)
    started = next(r for r in cluster.decodes[0].events if r.get("event") == "decode_started")

    async def total_blocks() -> int:
        async with operator.channel(started["address"], MEMBER_DNS_NAME) as channel:
            stub = instance_pb2_grpc.InstanceServiceStub(channel)
            reply = await stub.GetInstanceStatus(instance_pb2.GetInstanceStatusRequest())
            return int(reply.load.num_total_blocks)

    assert asyncio.run(total_blocks()) == decode["num_blocks"]
    line = next(line for line in _banner(cluster).splitlines() if "KV cache:" in line)
    assert (
        f"decode-0 {decode['num_tokens']:,} tokens ({decode['num_blocks']:,} blocks of 16, "
    ) in line
    assert f"prefill-0 {prefill['num_tokens']:,} tokens" in line


def test_cli_reports_a_crashed_child(demo_model_dir: Path, tmp_path: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "pdserve.launcher", "up", "--model", str(demo_model_dir),
         "--port", "0", "--grpc-port", "0", "--internal-port", "0", "--log-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        registry_address = ""
        for line in process.stdout:
            if "Registry (internal gRPC):" in line:
                registry_address = line.split()[-1]
                break
        assert registry_address, "the banner never came"
        pattern = f"pdserve.decode .*--gateway {registry_address}"
        pids = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
        os.kill(int(pids.split()[0]), signal.SIGKILL)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 1
    assert "decode-0" in stderr and "status -9" in stderr
    assert (tmp_path / "decode-0.log").is_file()


def test_pass_through_flags_take_their_value_as_written() -> None:
    args = parse_args(
        ["up", "--prefill-args", "--no-prefix-cache", "--decode-args", "--num-blocks 64",
         "--gateway-args", "--max-queue-len 8", "--prefills", "2"]
    )  # fmt: skip
    config = from_args(ClusterConfig, args)
    assert config.prefill_args == "--no-prefix-cache"
    assert config.decode_args == "--num-blocks 64"
    assert config.gateway_args == "--max-queue-len 8"
    assert config.prefills == 2
    joined = from_args(ClusterConfig, parse_args(["up", "--prefill-args=--no-prefix-cache"]))
    assert joined.prefill_args == "--no-prefix-cache"
    with pytest.raises(SystemExit):
        parse_args(["up", "--prefill-args"])
