"""bf16 KV blocks from a prefill's cache into a decode process, through every transport the
decode offers, with the prefill's own sender: on CPU here, and on a GPU both from a CUDA cache
into a CPU decode (shared memory, TCP, gRPC) and from CUDA to CUDA (CUDA IPC, device to device
into the decode's mapped cache; TCP, through pinned host buffers; gRPC). Where NIXL is installed,
also one-sided NIXL WRITEs from the sender's registered cache (DRAM or VRAM) into the decode's.
The decode checks every chunk's CRC-32C in its own cache or on arrival, so a commit it
acknowledges is a bit-exact round trip of the sender's blocks."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import torch

from pdserve.common.generation import SamplingParams, num_blocks_for
from pdserve.common.grpc_server import insecure_channel
from pdserve.engine.kv_cache import KVCache, KVCacheLayout
from pdserve.kv.transfer import sequence_pieces
from pdserve.kv.transports.cuda_ipc_window import MappedCaches
from pdserve.kv.transports.nixl import is_installed as nixl_installed
from pdserve.launcher.child import ChildProcess
from pdserve.prefill import convert
from pdserve.prefill.kv.nixl import NixlSide
from pdserve.prefill.kv.sender import KvSender
from pdserve.prefill.kv.shm import SharedPools
from pdserve.prefill.kv.transports import channels_for
from pdserve.prefill.request import Request
from pdserve.serving.convert import local_protocol
from pdserve.v1 import common_pb2, decode_pb2_grpc, instance_pb2, instance_pb2_grpc

HAS_CUDA = torch.cuda.is_available()
HAS_NIXL = nixl_installed()
BLOCK_SIZE = 16
NUM_TOKENS = 500  # 32 blocks (the tiny model holds 512 tokens), 8 chunks per layer
MAX_CHUNK_BYTES = 8 << 10


class Decode:
    """A `pdserve-decode` process on `device` with a bf16 cache, and channels to it."""

    def __init__(self, model: Path, device: str, log_dir: Path) -> None:
        argv = [sys.executable, "-m", "pdserve.decode", "--model", str(model), "--port", "0",
                "--device", device, "--dtype", "bfloat16", "--block-size", str(BLOCK_SIZE),
                "--num-blocks", "256", "--lease-ttl-ms", "60000", "--insecure"]  # fmt: skip
        self.child = ChildProcess(f"decode-{device}", argv, log_dir / f"decode-{device}.log")
        started = self.child.wait_for_event("decode_started", 120)
        self.address = str(started["address"])
        self.offered = {str(kind) for kind in started["kv_transports"]}

    def connect(self) -> None:
        """Opens the channels (on the event loop that will use them)."""
        self.channel = insecure_channel(self.address)
        self.stub = decode_pb2_grpc.DecodeServiceStub(self.channel)
        self.status = instance_pb2_grpc.InstanceServiceStub(self.channel)

    async def wait_idle(self, timeout_s: float = 30.0) -> common_pb2.PoolIntegrity:
        """The pool once every block is free again, checked whole."""
        request = instance_pb2.GetInstanceStatusRequest(check_integrity=True)
        deadline = time.monotonic() + timeout_s
        while True:
            pool = (await self.status.GetInstanceStatus(request, timeout=5)).pool
            if pool.num_free_blocks == pool.num_total_blocks and not pool.num_open_leases:
                return pool
            assert time.monotonic() < deadline, f"the decode pool did not drain: {pool}"
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        await self.channel.close()
        self.child.signal(15)
        self.child.wait(20)
        self.child.close()


DecodeFactory = Callable[[str], Awaitable[Decode]]


@pytest.fixture
async def start_decode(tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[DecodeFactory]:
    started: list[Decode] = []

    async def start(device: str) -> Decode:
        decode = await asyncio.to_thread(Decode, tiny_model_dir, device, tmp_path)
        decode.connect()
        started.append(decode)
        return decode

    yield start
    for decode in started:
        await decode.close()


async def send(
    decode: Decode, kv_cache: KVCache, transport: str, request_id: str, nixl: NixlSide | None
) -> int:
    """Leases `NUM_TOKENS` tokens' blocks and ships them on `transport`; the bytes acknowledged."""
    status = await decode.status.GetInstanceStatus(instance_pb2.GetInstanceStatusRequest())
    request = Request(
        request_id=request_id,
        token_ids=[5] * NUM_TOKENS,
        num_prompt_tokens=NUM_TOKENS,
        sampling=SamplingParams(temperature=0.0, max_tokens=2),
        seed=0,
        decode_address=decode.address,
        # NOTE: every other block, so the sender gathers (not views) what it ships.
        block_ids=list(range(0, 2 * num_blocks_for(NUM_TOKENS, BLOCK_SIZE), 2)),
    )
    allocate = convert.allocate_request(
        request, status.instance.kv_layout, local_protocol(), sender="test"
    )
    response = await decode.stub.AllocateBlocks(allocate, timeout=30)
    request.lease = convert.lease_from_proto(response.lease)
    channels = channels_for(
        request,
        decode.stub,
        SharedPools(kv_cache.layout),
        [transport],
        MappedCaches(kv_cache),
        nixl,
    )
    sender = KvSender(request, channels)
    for piece in sequence_pieces(kv_cache, request.block_ids, MAX_CHUNK_BYTES):
        sender.put(piece)
    sender.commit(7, request.first_token_index)
    result = await sender.run()
    assert result.transport == transport
    return result.num_bytes


@pytest.mark.parametrize(
    ("sender_device", "decode_device"),
    [
        pytest.param("cpu", "cpu", id="cpu-to-cpu"),
        pytest.param("cuda", "cpu", id="cuda-to-cpu", marks=pytest.mark.gpu),
        pytest.param("cuda", "cuda", id="cuda-to-cuda", marks=pytest.mark.gpu),
    ],
)
async def test_bf16_kv_crosses_every_offered_transport_bit_exact(
    start_decode: DecodeFactory, sender_device: str, decode_device: str
) -> None:
    if "cuda" in (sender_device, decode_device) and not HAS_CUDA:
        pytest.skip("needs CUDA")
    decode = await start_decode(decode_device)
    # NOTE: shared memory writes into the decode's cache from the host: CPU caches only; CUDA
    # IPC maps a CUDA cache; TCP reads into a CUDA cache through pinned host buffers.
    # NIXL registers either cache (DRAM or VRAM) where its extra is installed.
    expected = {"grpc", "tcp"} | ({"shm"} if decode_device == "cpu" else {"cuda_ipc"})
    if HAS_NIXL:
        expected.add("nixl")
    assert decode.offered == expected
    layout_message = (
        await decode.status.GetInstanceStatus(instance_pb2.GetInstanceStatusRequest())
    ).instance.kv_layout
    layout = KVCacheLayout(
        num_layers=layout_message.num_layers,
        num_kv_heads=layout_message.num_kv_heads,
        head_dim=layout_message.head_dim,
        block_size=layout_message.block_size,
        dtype="bfloat16",
    )
    kv_cache = KVCache(
        layout, 2 * num_blocks_for(NUM_TOKENS, BLOCK_SIZE), torch.device(sender_device)
    )
    kv_cache.kv.normal_()
    num_bytes = 2 * layout.num_layers * num_blocks_for(NUM_TOKENS, BLOCK_SIZE) * layout.block_nbytes
    nixl = NixlSide(kv_cache) if HAS_NIXL else None
    try:
        for transport in sorted(expected):
            sent = await send(decode, kv_cache, transport, f"bf16-{transport}", nixl)
            assert sent == num_bytes
            pool = await decode.wait_idle()
            assert pool.is_consistent, pool.detail
    finally:
        if nixl is not None:
            nixl.close()
