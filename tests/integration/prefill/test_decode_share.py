"""A prefill over its share of a decode's pool waits for its own leases instead of failing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from support.ports import free_port
from support.prefill_cluster import BLOCK_SIZE, start_decode

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import SamplingParams
from pdserve.prefill.decode_client import DecodePeers
from pdserve.prefill.request import Request
from pdserve.v1 import common_pb2


def _request(request_id: str, address: str, num_tokens: int) -> Request:
    return Request(
        request_id=request_id,
        token_ids=[5] * num_tokens,
        num_prompt_tokens=num_tokens,
        sampling=SamplingParams(temperature=0.0, max_tokens=2),
        seed=0,
        decode_address=address,
    )


async def test_a_share_refusal_is_waited_out_until_the_deadline(tiny_model_dir: Path) -> None:
    # 32 blocks, share 0.5: 16 blocks per prefill while both ask. Each 6-block lease fits
    # alone; the third of prefill A's is over its share until one of its own leases ends.
    decode = await start_decode(tiny_model_dir, num_blocks=32)
    layout = decode.host.kv_layout
    tokens = 6 * BLOCK_SIZE
    a = DecodePeers("prefill-a", layout, prepare_concurrency=4, allocate_timeout_s=3.0)
    b = DecodePeers("prefill-b", layout, prepare_concurrency=4, allocate_timeout_s=0.3)
    try:
        held = [await a.allocate(_request(f"a{i}", decode.address, tokens)) for i in range(2)]
        other = await b.allocate(_request("b0", decode.address, BLOCK_SIZE))
        third = asyncio.ensure_future(a.allocate(_request("a2", decode.address, tokens)))
        await asyncio.sleep(0.5)
        assert not third.done()  # waiting, not failed
        await a.release_lease(decode.address, held[0], "a0")
        granted = await asyncio.wait_for(third, 30)
        assert len(granted.block_ids) == 6
        # B's deadline is short: over its share it fails with the decode's reason.
        b_held = [await b.allocate(_request(f"b{i}", decode.address, tokens)) for i in (1, 2)]
        with pytest.raises(PdserveError) as refused:
            await b.allocate(_request("b3", decode.address, tokens))
        assert refused.value.reason is ErrorReason.DECODE_CAPACITY_EXHAUSTED
        for peers, lease, request_id in (
            (a, held[1], "a1"), (a, granted, "a2"), (b, other, "b0"),
            (b, b_held[0], "b1"), (b, b_held[1], "b2"),
        ):  # fmt: skip
            assert await peers.release_lease(decode.address, lease, request_id)
    finally:
        await a.close()
        await b.close()
        await decode.stop(grace=None)


async def test_a_decode_reached_a_moment_late_still_grants_the_lease(
    tiny_model_dir: Path,
) -> None:
    # NOTE: the decode is stopped and started again at its address a moment after the
    # allocation began: the channel fails the first call at once (as one whose connection was
    # just lost does) and connects again within its backoff; the allocation waits for that
    # instead of failing its request.
    decode = await start_decode(tiny_model_dir, num_blocks=32)
    layout, address = decode.host.kv_layout, decode.address
    await decode.stop(grace=None)
    peers = DecodePeers("prefill-a", layout, prepare_concurrency=4, allocate_timeout_s=10.0)
    try:
        started = asyncio.ensure_future(peers.allocate(_request("late", address, BLOCK_SIZE)))
        await asyncio.sleep(0.3)
        assert not started.done(), "the allocation failed at the first refused connection"
        port = int(address.rsplit(":", 1)[1])
        decode = await start_decode(tiny_model_dir, num_blocks=32, port=port)
        lease = await asyncio.wait_for(started, 30)
        assert len(lease.block_ids) == 1
        assert await peers.release_lease(address, lease, "late")
    finally:
        await peers.close()
        await decode.stop(grace=None)


async def test_a_decode_that_stays_unreachable_fails_the_allocation_typed() -> None:
    address = f"127.0.0.1:{free_port()}"
    layout = common_pb2.KvLayout()
    peers = DecodePeers("prefill-a", layout, prepare_concurrency=4, allocate_timeout_s=10.0)
    try:
        with pytest.raises(PdserveError) as failed:
            await asyncio.wait_for(peers.allocate(_request("never", address, BLOCK_SIZE)), 30)
        assert failed.value.reason is ErrorReason.PEER_UNAVAILABLE
        assert failed.value.metadata["decodeAddress"] == address
        assert f"decode {address} was unreachable during AllocateBlocks" in failed.value.message
    finally:
        await peers.close()
