"""NIXL between two hosts: UCX's TCP transport from a sender on one test host into a decode on
another (network namespaces, `support.netns`), and a partition in the middle of a write.

Both ends limit UCX to TCP on their host's interface (``UCX_TLS=tcp``, ``UCX_NET_DEVICES``; on
one machine UCX would otherwise copy through the kernel, which a partition does not stop). The
sender is `support/nixl_writer.py`, driven line by line. A lease is written completely (every
chunk's checksum verified in the decode's cache) and committed; then another lease gets its
first layer, the decode's link goes down, and the second layer's WRITE never completes: the
sender gives up on the decode (its window's timeout, 2 s here) and cancels its stream once the
link is up again. Nothing commits, every block returns, and the next transfer loads the
decode's agent again and goes through.

Needs root (``ip netns``) and NIXL: it fails, never skips, where namespaces cannot be made.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from support.netns import TestNetwork

from pdserve.common.grpc_server import insecure_channel
from pdserve.kv.transports import nixl
from pdserve.launcher.child import ChildProcess
from pdserve.serving.convert import local_protocol
from pdserve.v1 import decode_pb2, decode_pb2_grpc, instance_pb2, instance_pb2_grpc

try:
    nixl.load_api()
except nixl.NixlUnavailable as missing:
    pytest.skip(f"{missing}", allow_module_level=True)

BLOCK_SIZE = 4
NUM_TOKENS = 64  # 16 blocks
WRITER = Path(__file__).parents[1] / "support" / "nixl_writer.py"
# NOTE: each host's own interface only (UCX would also offer loopback).
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}


@pytest.fixture
def network() -> Iterator[TestNetwork]:
    with TestNetwork(("prefill", "decode")) as made:
        yield made


class Decode:
    """A `pdserve-decode` on its test host, NIXL over UCX's TCP only."""

    def __init__(self, model: Path, network: TestNetwork, log_dir: Path) -> None:
        self.host = network.hosts["decode"]
        argv = [sys.executable, "-m", "pdserve.decode", "--model", str(model), "--port", "0",
                "--host", self.host.address, "--block-size", str(BLOCK_SIZE),
                "--num-blocks", "64", "--dtype", "float32", "--kv-transports", "nixl",
                "--lease-ttl-ms", "60000", "--insecure"]  # fmt: skip
        env = {**os.environ, **UCX_ENV}
        self.child = ChildProcess("decode", self.host.command(argv), log_dir / "decode.log", env)
        started = self.child.wait_for_event("decode_started", 120)
        assert started["kv_transports"] == ["nixl", "grpc"]
        self.address = str(started["address"])


@pytest.fixture
async def decode(
    tiny_model_dir: Path, network: TestNetwork, tmp_path: Path
) -> AsyncIterator[Decode]:
    started = await asyncio.to_thread(Decode, tiny_model_dir, network, tmp_path)
    yield started
    started.child.signal(15)
    started.child.wait(20)
    started.child.close()


async def _lease(
    stub: decode_pb2_grpc.DecodeServiceStub,
    status: instance_pb2_grpc.InstanceServiceStub,
    request_id: str,
) -> decode_pb2.Lease:
    instance = (await status.GetInstanceStatus(instance_pb2.GetInstanceStatusRequest())).instance
    response = await stub.AllocateBlocks(
        decode_pb2.AllocateBlocksRequest(
            request_id=request_id,
            num_prompt_tokens=NUM_TOKENS,
            max_new_tokens=4,
            kv_layout=instance.kv_layout,
            protocol=local_protocol(),
        )
    )
    return response.lease


class Writer:
    """`support/nixl_writer.py` on the prefill's test host."""

    def __init__(self, network: TestNetwork, decode: Decode, layout: list[str]) -> None:
        argv = [sys.executable, str(WRITER), decode.address, *layout]
        self.process = subprocess.Popen(
            network.hosts["prefill"].command(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **UCX_ENV},
        )
        self.wait_for("ready")

    def wait_for(self, prefix: str) -> str:
        """The next line the writer prints that starts with `prefix` (NIXL logs there too)."""
        assert self.process.stdout is not None
        while line := self.process.stdout.readline():
            if line.startswith(prefix):
                return line.strip()
        raise AssertionError(f"the writer ended before {prefix!r}")

    async def ask(self, command: str, *answers: str) -> str:
        """Sends `command`; the writer's answer (the first line starting with one of
        `answers`)."""
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return await asyncio.to_thread(self._answer, answers)

    def _answer(self, answers: tuple[str, ...]) -> str:
        assert self.process.stdout is not None
        while line := self.process.stdout.readline():
            if line.startswith(answers):
                return line.strip()
        raise AssertionError(f"the writer ended before answering {answers}")

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


async def _pool_whole(status: instance_pb2_grpc.InstanceServiceStub, timeout_s: float) -> None:
    request = instance_pb2.GetInstanceStatusRequest(check_integrity=True)
    deadline = time.monotonic() + timeout_s
    while True:
        pool = (await status.GetInstanceStatus(request, timeout=5)).pool
        if pool.num_free_blocks == pool.num_total_blocks and not pool.num_open_leases:
            assert pool.is_consistent, pool.detail
            return
        assert time.monotonic() < deadline, f"the decode's blocks did not return: {pool}"
        await asyncio.sleep(0.05)


async def test_nixl_over_tcp_between_hosts_and_a_partition_mid_write(
    decode: Decode, network: TestNetwork
) -> None:
    channel = insecure_channel(decode.address)
    stub = decode_pb2_grpc.DecodeServiceStub(channel)
    status = instance_pb2_grpc.InstanceServiceStub(channel)
    proto = (await status.GetInstanceStatus(instance_pb2.GetInstanceStatusRequest())).instance
    shape = proto.kv_layout
    layout = [str(n) for n in (shape.num_layers, shape.num_kv_heads, shape.head_dim, BLOCK_SIZE)]
    writer = await asyncio.to_thread(Writer, network, decode, [*layout, "float32"])
    outcomes = ("done", "failed", "committed")
    try:
        # A whole transfer over TCP: every layer, verified in the decode's cache, committed.
        lease = await _lease(stub, status, "whole")
        await writer.ask(f"lease {lease.SerializeToString().hex()}", "open")
        for layer_index in range(shape.num_layers):
            assert await writer.ask(f"layer {layer_index}", *outcomes) == f"done {layer_index}"
        assert await writer.ask("commit", *outcomes) == "committed LEASE_STATE_COMMITTED"
        await stub.ReleaseLease(
            decode_pb2.ReleaseLeaseRequest(lease_id=lease.lease_id, request_id="whole")
        )
        await _pool_whole(status, 10)

        # A partition between the first layer and the second.
        lease = await _lease(stub, status, "cut")
        await writer.ask(f"lease {lease.SerializeToString().hex()}", "open")
        assert await writer.ask("layer 0", *outcomes) == "done 0"
        network.partition("decode")
        try:
            answer = await writer.ask("layer 1", *outcomes)
        finally:
            network.heal("decode")
        assert answer.startswith("failed") and "not done" in answer, answer
        await writer.ask("cancel", "cancelled")
        await _pool_whole(status, 20)

        # The next transfer loads the decode's agent again and goes through.
        lease = await _lease(stub, status, "after")
        await writer.ask(f"lease {lease.SerializeToString().hex()}", "open")
        assert await writer.ask("layer 0", *outcomes) == "done 0"
        await writer.ask("cancel", "cancelled")
        await _pool_whole(status, 20)
    finally:
        writer.close()
        await channel.close()
