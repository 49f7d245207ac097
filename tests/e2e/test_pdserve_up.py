"""`pdserve up` as a user runs it: separate processes, the openai SDK, a clean stop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from support.etcd_server import running_etcd
from support.eventually import eventually
from support.launcher_cli import running_launcher
from support.ports import gateway_ports
from support.real_cluster import Reference
from support.resumable_sse import chat_content, sse_events

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


async def test_once_every_service_is_up_the_fork_server_settles(cluster: Cluster) -> None:
    assert cluster.fork_server is not None
    log = cluster.log_dir / "fork-server.log"

    def settled() -> list[str]:
        return [line for line in log.read_text().splitlines() if "fork_server_settled" in line]

    await eventually(lambda: bool(settled()), what="the fork server settled")
    [line] = settled()
    assert "failed_regions=0" in line


MAX_GATEWAYS = 2
"""The most gateways a case here starts."""


def _up_args(model_dir: Path, log_dir: Path, *more: str) -> list[str]:
    # NOTE: ports below the ephemeral range: a gateway the launcher restarts binds the ones it
    # had, and one drawn from the range could meanwhile be another socket's.
    port, grpc_port, internal_port = gateway_ports(MAX_GATEWAYS)
    return ["--model", str(model_dir), "--port", str(port), "--grpc-port", str(grpc_port),
            "--internal-port", str(internal_port), "--log-dir", str(log_dir), *more]  # fmt: skip


def _logged(path: Path, event: str) -> list[dict[str, Any]]:
    """The records of `event` in a service's log."""
    records = (json.loads(line) for line in path.read_text().splitlines() if line.startswith("{"))
    return [record for record in records if record.get("event") == event]


async def _completes(url: str) -> bool:
    """Whether a short completion through the gateway at `url` succeeds."""
    try:
        async with httpx.AsyncClient(timeout=30) as http:
            models = (await http.get(f"{url}/v1/models")).json()["data"]
            if not models:
                return False
            body = {"model": models[0]["id"], "prompt": "Hello", "max_tokens": 4}
            response = await http.post(f"{url}/v1/completions", json=body)
    except httpx.TransportError:
        return False
    return response.status_code == 200


async def test_cli_restarts_crashed_children_then_gives_up(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    args = _up_args(demo_model_dir, tmp_path, "--max-restarts", "1", "--restart-backoff-s", "0.1")
    with running_launcher(args) as launcher:
        launcher.wait_for_banner(120)
        pids = launcher.pids
        assert set(pids) == {"gateway", "prefill-0", "decode-0"}
        url = launcher.rest_urls[0]

        async def kill_and_wait_for_restart(name: str, pid: int) -> int:
            num_restarted = len(launcher.events("service_restarted"))
            os.kill(pid, signal.SIGKILL)
            await eventually(
                lambda: len(launcher.events("service_restarted")) > num_restarted,
                20,
                f"the launcher restarted {name}",
            )
            exited = launcher.events("service_exited")[-1]
            assert (exited["service"], exited["pid"], exited["signal"]) == (
                name, str(pid), "SIGKILL"
            )  # fmt: skip
            restarted = launcher.events("service_restarted")[-1]
            assert restarted["service"] == name and int(restarted["pid"]) != pid
            return int(restarted["pid"])

        # NOTE: the gateway comes back on its port (the embedded registry's too): the
        # instances register with it again and it serves.
        await kill_and_wait_for_restart("gateway", pids["gateway"])

        def num_registered(name: str) -> int:
            return len(_logged(tmp_path / f"{name}.log", "registered"))

        await eventually(lambda: num_registered("prefill-0") >= 2, 60, "prefill-0 back")
        await eventually(lambda: num_registered("decode-0") >= 2, 60, "decode-0 back")
        await eventually(lambda: _completes(url), 30, "the restarted gateway serves")
        # NOTE: a new decode registers again, on a port of its own; its log holds both runs.
        new_pid = await kill_and_wait_for_restart("decode-0", pids["decode-0"])
        await eventually(lambda: num_registered("decode-0") >= 3, 60, "decode-0 back")
        await eventually(lambda: _completes(url), 30, "the gateway serves with the new decode")
        assert launcher.process.poll() is None
        exited = [e["service"] for e in launcher.events("service_exited")]
        assert exited == ["gateway", "decode-0"], "another service went down"
        # NOTE: its one restart used, the decode's next exit stops the cluster.
        os.kill(new_pid, signal.SIGKILL)
        status = await asyncio.to_thread(launcher.process.wait, 60)
    stderr = "\n".join(launcher.stderr)
    assert status == 1
    assert "decode-0" in stderr and "status -9" in stderr
    assert "no restarts left (--max-restarts 1)" in stderr
    (exhausted,) = launcher.events("service_restarts_exhausted")
    assert exhausted["service"] == "decode-0"


# NOTE: bounds only a run that goes wrong: idle services drain at once.
SERVICES_GONE_WAIT_S = 120
STOPPED_EVENTS = {"gateway": "gateway_stopped", "prefill": "prefill_stopped",
                  "decode": "decode_stopped"}  # fmt: skip


def test_the_services_of_a_killed_launcher_drain_stop_and_say_so(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    """`kill -9` of `pdserve up` (or the OOM killer): its services run in sessions of their own,
    so nothing signals them; each sees its supervisor gone (`pdserve.common.supervisor`) and
    drains and stops as on SIGTERM, its last lines in its own log file. No process, and no
    shared-memory segment of the decode's, is left."""
    with running_launcher(_up_args(demo_model_dir, tmp_path)) as launcher:
        launcher.wait_for_banner(120)
        pids = launcher.pids
        exits = {name: os.pidfd_open(pid) for name, pid in pids.items()}
        launcher.process.kill()
        launcher.process.wait()
    try:
        for name, fd in exits.items():
            ready, _, _ = select.select([fd], [], [], SERVICES_GONE_WAIT_S)
            assert ready, f"{name} still runs {SERVICES_GONE_WAIT_S} s after its launcher died"
    finally:
        for name, fd in exits.items():
            os.close(fd)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids[name], signal.SIGKILL)
    for name in pids:
        log_path = tmp_path / f"{name}.log"
        (gone,) = _logged(log_path, "supervisor_gone")
        (stopped,) = _logged(log_path, STOPPED_EVENTS[name.split("-")[0]])
        assert gone["timestamp"] <= stopped["timestamp"]
    assert not list(Path("/dev/shm").glob(f"pdserve-kv-{pids['decode-0']}-*"))


def test_a_taken_gateway_port_is_refused_before_anything_starts(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    """An earlier `pdserve up` still running: the next one says which port and flag, at once
    (every gateway port is checked the same way: the public gRPC one here)."""
    flag = "--grpc-port"
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        args = _up_args(demo_model_dir, tmp_path)
        args[args.index(flag) + 1] = str(port)
        result = subprocess.run(
            [sys.executable, "-m", "pdserve.launcher", "up", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 1
    assert (
        f"port {port} on 127.0.0.1 is in use (another pdserve up still running?); stop that, "
        f"or pick free ports with {flag}"
    ) in result.stderr
    assert "fork_server_ready" not in result.stderr + result.stdout
    assert list(tmp_path.iterdir()) == []


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


INSTANCE_ARGS = "--registry-ttl-s 2 --heartbeat-interval-s 0.3"
GATEWAY_ARGS = "--instance-ttl-s 3 --heartbeat-interval-s 0.3"
NUM_CHAT_TOKENS = 300


async def _serves(url: str) -> bool:
    """Whether the gateway at `url` answers and lists a model."""
    try:
        async with httpx.AsyncClient(timeout=5) as http:
            response = await http.get(f"{url}/v1/models")
    except httpx.TransportError:
        return False
    return response.status_code == 200 and bool(response.json()["data"])


async def test_a_killed_gateway_is_restarted_and_its_resumable_stream_goes_on_elsewhere(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    """`pdserve up --gateways 2 --registry etcd://...`: gateway A is SIGKILLed in the middle of
    a resumable chat stream; the client resumes through gateway B and gets the rest of the
    greedy completion; the launcher restarts A on its ports while B, the prefill and the decode
    run on."""
    with running_etcd(tmp_path) as etcd:
        args = _up_args(
            demo_model_dir, tmp_path / "logs", "--gateways", "2", "--registry", etcd.spec,
            "--restart-backoff-s", "0.2", "--prefill-args", INSTANCE_ARGS,
            "--decode-args", INSTANCE_ARGS, "--gateway-args", GATEWAY_ARGS,
        )  # fmt: skip
        with running_launcher(args) as launcher:
            launcher.wait_for_banner(120)
            first, other = launcher.rest_urls
            pids = launcher.pids
            assert set(pids) == {"gateway", "gateway-1", "prefill-0", "decode-0"}
            await eventually(lambda: _serves(first), 30, "gateway A serves")
            await eventually(lambda: _serves(other), 30, "gateway B serves")
            async with httpx.AsyncClient(timeout=60) as http:
                model = (await http.get(f"{other}/v1/models")).json()["data"][0]["id"]
                body = {
                    "model": model,
                    "messages": [{"role": "user", "content": "Tell me a story"}],
                    "max_tokens": NUM_CHAT_TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                }
                whole = await http.post(f"{other}/v1/chat/completions", json=body)
                undisturbed = chat_content(sse_events(whole.text))
                resumable = {**body, "stream_options": {"resumable": True, "include_usage": True}}
                lines: list[str] = []
                async with http.stream(
                    "POST", f"{first}/v1/chat/completions", json=resumable
                ) as got:
                    assert got.status_code == 200
                    stream_id = got.headers["x-request-id"]
                    async for line in got.aiter_lines():
                        lines.append(line)
                        if len(sse_events("\n".join(lines))) >= 4:
                            os.kill(pids["gateway"], signal.SIGKILL)
                            break
                before = sse_events("\n".join(lines))
                last_id = before[-1][0]
                assert 0 < last_id < NUM_CHAT_TOKENS, "the kill did not land mid-stream"
                url = f"{other}/v1/chat/completions/chatcmpl-{stream_id}/stream"
                resumed = await http.get(url, params={"starting_after": last_id})
                assert resumed.status_code == 200, resumed.text
                after = sse_events(resumed.text)
                assert after[-1][1] == "[DONE]"
                assert chat_content(before) + chat_content(after) == undisturbed
                usage = [d["usage"] for _, d in after if isinstance(d, dict) and d.get("usage")]
                assert usage[-1]["completion_tokens"] == NUM_CHAT_TOKENS

                # NOTE: A shows no token before its record says where the request runs, so B
                # takes the stream over from the decode; unless A had every token and stored the
                # end before the kill (the client reads behind A on a busy machine), then B
                # replays it from the store. The launcher copies B's lines into its log file
                # from a pipe: on a busy machine a moment late.
                def resumed_how() -> list[str]:
                    resumed = _logged(
                        tmp_path / "logs" / "gateway-1.log", "resumable_request_resumed"
                    )
                    return [e["how"] for e in resumed if e["request_id"] == stream_id]

                await eventually(lambda: bool(resumed_how()), 30, "B logged the resume")
                assert resumed_how() in (["takeover"], ["stored"])

                # NOTE: the launcher saw A die, started it again on its ports, and it serves.
                await eventually(
                    lambda: launcher.events("service_restarted"), 30, "gateway A restarted"
                )
                (exited,) = launcher.events("service_exited")
                assert exited["service"] == "gateway" and exited["signal"] == "SIGKILL"
                assert exited["pid"] == str(pids["gateway"])
                (restarted,) = launcher.events("service_restarted")
                assert restarted["service"] == "gateway"
                assert int(restarted["pid"]) != pids["gateway"]
                await eventually(lambda: _serves(first), 30, "gateway A serves again")
                short = {**body, "max_tokens": 8, "stream": False}
                again = await http.post(f"{first}/v1/chat/completions", json=short)
                assert again.status_code == 200, again.text
                # NOTE: A, back, resumes the stream too (it reads the record from etcd).
                replay = await http.get(
                    f"{first}/v1/chat/completions/chatcmpl-{stream_id}/stream",
                    headers={"Last-Event-ID": str(last_id)},
                )
                assert chat_content(sse_events(replay.text)) == chat_content(after)

            assert launcher.process.poll() is None, "the launcher stopped"
            for name in ("gateway-1", "prefill-0", "decode-0"):
                os.kill(pids[name], 0)  # raises if it died
            assert len(launcher.events("service_exited")) == 1
            status = await asyncio.to_thread(launcher.stop, 60)
        assert status == 0
