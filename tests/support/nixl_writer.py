"""A NIXL sender in a process of its own, for the test that SIGKILLs a sender mid-write.

    python nixl_writer.py DECODE_ADDRESS NUM_LAYERS NUM_KV_HEADS HEAD_DIM BLOCK_SIZE DTYPE

Starts its agent with a random cache of that layout registered and prints ``ready``; then reads
one Lease (serialized, in hex) from stdin, opens a nixl SyncCache for it, WRITEs the first layer
and announces it (chunk messages), posts the second layer's WRITEs without waiting for them,
prints ``writing`` and waits to be killed: the commit never comes.
"""

from __future__ import annotations

import asyncio
import sys

import torch

from pdserve.common.grpc_server import insecure_channel
from pdserve.engine.kv_cache import KVCache, KVCacheLayout
from pdserve.kv.nixl import CacheAgent, NixlPeers
from pdserve.kv.transfer import layer_pieces
from pdserve.prefill.convert import lease_from_proto
from pdserve.v1 import decode_pb2, decode_pb2_grpc


async def main(address: str, layout: KVCacheLayout) -> None:
    source = KVCache(layout, 64, torch.device("cpu"))
    source.kv.normal_()
    peers = NixlPeers(CacheAgent(source, "prefill"))
    print("ready", flush=True)
    lease = decode_pb2.Lease.FromString(bytes.fromhex(sys.stdin.readline().strip()))
    grant = lease_from_proto(lease)
    (target,) = [o.nixl for o in grant.transports if o.kind == "nixl"]
    assert target is not None
    window = peers.window(target)
    num_blocks = len(lease.block_ids)
    channel = insecure_channel(address)
    call = decode_pb2_grpc.DecodeServiceStub(channel).SyncCache()
    await call.write(
        decode_pb2.SyncCacheRequest(
            header=decode_pb2.SyncCacheHeader(
                lease_id=lease.lease_id,
                request_id="r",
                token_ids=list(range(1, num_blocks * layout.block_size + 1)),
                transport_token=grant.transport_token,
                transport=decode_pb2.TRANSPORT_KIND_NIXL,
            )
        )
    )
    assert dict(await call.initial_metadata()).get("pdserve-sync-accepted") == "1"
    for piece in layer_pieces(source, 0, range(num_blocks), 1):
        crc = window.write(piece)
        window.wait()
        chunk = decode_pb2.KvChunk(
            layer_index=0, first_block=piece.first_block, num_blocks=1, crc32c=crc
        )
        await call.write(decode_pb2.SyncCacheRequest(chunk=chunk))
    for piece in layer_pieces(source, 1, range(num_blocks), 1):
        window.write(piece)
    window.post()  # NOTE: never waited for
    print("writing", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    address, num_layers, num_kv_heads, head_dim, block_size, dtype = sys.argv[1:7]
    layout = KVCacheLayout(
        int(num_layers), int(num_kv_heads), int(head_dim), int(block_size), dtype
    )
    asyncio.run(main(address, layout))
