"""A NIXL sender in a process of its own, driven line by line: for the tests that SIGKILL a
sender mid-write and that cut a sender off by a partition (on a test host of its own).

    python nixl_writer.py DECODE_ADDRESS NUM_LAYERS NUM_KV_HEADS HEAD_DIM BLOCK_SIZE DTYPE

Starts its agent with a random cache of that layout registered (64 blocks) and prints
``ready``. Then, one command per stdin line, each answered with one line:

* ``lease HEX``: a Lease (serialized, in hex): opens a nixl SyncCache for it (``open``).
* ``layer I``: WRITEs layer I of the lease's blocks and announces its chunks (``done I``), or
  ``failed REASON`` when a WRITE fails or times out (2 s).
* ``post I``: posts layer I's WRITEs without waiting for them (``posted I``).
* ``commit``: the commit of every chunk announced (``committed STATE`` or ``failed REASON``).
* ``cancel``: cancels the stream (``cancelled``).
"""

from __future__ import annotations

import asyncio
import sys

import grpc
import torch

from pdserve.common.generation import SamplingParams
from pdserve.common.grpc_server import insecure_channel
from pdserve.engine.kv_cache import KVCache, KVCacheLayout
from pdserve.kv.transfer import layer_pieces
from pdserve.kv.transports.nixl import CacheAgent, NixlPeers, NixlUnavailable
from pdserve.kv.transports.nixl_window import NixlWindow
from pdserve.prefill.convert import lease_from_proto
from pdserve.serving.convert import sampling_to_proto
from pdserve.v1 import decode_pb2, decode_pb2_grpc

WRITE_TIMEOUT_S = 2.0


class Writer:
    def __init__(self, address: str, layout: KVCacheLayout) -> None:
        self.source = KVCache(layout, 64, torch.device("cpu"))
        self.source.kv.normal_()
        self.peers = NixlPeers(CacheAgent(self.source, "prefill"))
        self.stub = decode_pb2_grpc.DecodeServiceStub(insecure_channel(address))
        self.num_chunks = 0
        self.num_bytes = 0

    async def open(self, lease: decode_pb2.Lease) -> str:
        grant = lease_from_proto(lease)
        (target,) = [o.nixl for o in grant.transports if o.kind == "nixl"]
        assert target is not None
        self.num_blocks = len(lease.block_ids)
        self.window = NixlWindow(self.peers, target, timeout_s=WRITE_TIMEOUT_S)
        self.call = self.stub.SyncCache()
        block_size = self.source.layout.block_size
        header = decode_pb2.SyncCacheHeader(
            lease_id=lease.lease_id,
            request_id="r",
            token_ids=list(range(1, self.num_blocks * block_size + 1)),
            transport_token=grant.transport_token,
            transport=decode_pb2.TRANSPORT_KIND_NIXL,
            sampling=sampling_to_proto(SamplingParams(temperature=0.0, max_tokens=4)),
        )
        await self.call.write(decode_pb2.SyncCacheRequest(header=header))
        assert dict(await self.call.initial_metadata()).get("pdserve-sync-accepted") == "1"
        return "open"

    def _take(self, layer_index: int) -> list[tuple[int, int, int]]:
        return [
            (piece.first_block, piece.num_blocks, self.window.write(piece))
            for piece in layer_pieces(self.source, layer_index, range(self.num_blocks), 4)
        ]

    async def layer(self, layer_index: int) -> str:
        chunks = self._take(layer_index)
        try:
            await asyncio.to_thread(self.window.wait)
        except NixlUnavailable as error:
            return f"failed {error}"
        for first_block, num_blocks, crc in chunks:
            chunk = decode_pb2.KvChunk(
                layer_index=layer_index, first_block=first_block, num_blocks=num_blocks, crc32c=crc
            )
            await self.call.write(decode_pb2.SyncCacheRequest(chunk=chunk))
            self.num_chunks += 1
            self.num_bytes += 2 * num_blocks * self.source.layout.block_nbytes
        return f"done {layer_index}"

    async def post(self, layer_index: int) -> str:
        self._take(layer_index)
        self.window.post()
        return f"posted {layer_index}"

    async def commit(self) -> str:
        commit = decode_pb2.SyncCacheCommit(
            num_chunks=self.num_chunks,
            num_bytes=self.num_bytes,
            first_token_id=7,
            first_token_index=0,  # NOTE: a fresh prompt: no completion token before
        )
        await self.call.write(decode_pb2.SyncCacheRequest(commit=commit))
        await self.call.done_writing()
        try:
            response = await self.call
        except grpc.aio.AioRpcError as error:
            return f"failed {error.details()}"
        return f"committed {decode_pb2.LeaseState.Name(response.state)}"


async def main(address: str, layout: KVCacheLayout) -> None:
    writer = Writer(address, layout)
    print("ready", flush=True)
    while line := (await asyncio.to_thread(sys.stdin.readline)).split():
        command, *args = line
        if command == "lease":
            answer = await writer.open(decode_pb2.Lease.FromString(bytes.fromhex(args[0])))
        elif command == "layer":
            answer = await writer.layer(int(args[0]))
        elif command == "post":
            answer = await writer.post(int(args[0]))
        elif command == "commit":
            answer = await writer.commit()
        else:
            writer.call.cancel()
            answer = "cancelled"
        print(answer, flush=True)


if __name__ == "__main__":
    address, *shape, dtype = sys.argv[1:7]
    num_layers, num_kv_heads, head_dim, block_size = (int(n) for n in shape)
    asyncio.run(main(address, KVCacheLayout(num_layers, num_kv_heads, head_dim, block_size, dtype)))
