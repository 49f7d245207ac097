"""A real decode server shares a prompt's full KV blocks between completions of one share key:
the second completion receives only its partial block, decodes exactly what it would have
decoded alone, and a transfer that would write into, or disagree with, the shared blocks
fails."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import grpc
import pytest
from support.decode_harness import BLOCK_SIZE, DecodeClient, Prefilled, tokens_of

from pdserve.common import errors
from pdserve.common.errors import ErrorReason
from pdserve.common.generation import SamplingParams
from pdserve.decode.request import DecodeRequest
from pdserve.v1 import decode_pb2

PROMPT = [5, 17, 42, 99, 7, 63, 120, 33, 8, 250, 11]  # 2 full blocks of 4 and a partial one
NUM_FULL = len(PROMPT) // BLOCK_SIZE


def _sampling(seed: int | None) -> SamplingParams:
    if seed is None:
        return SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    return SamplingParams(temperature=0.9, top_p=0.95, seed=seed, max_tokens=16, ignore_eos=True)


@contextlib.contextmanager
def admissions_held(client: DecodeClient) -> Iterator[None]:
    """Holds the committed requests back from the decode loop until the block ends, then admits
    them in order: a first completion that decoded all its tokens before the second one asked
    (beside two busy loops it did) would have freed the blocks the second one shares."""
    loop = client.instance.loop
    held: list[DecodeRequest] = []
    loop.submit = held.append  # type: ignore[method-assign]
    try:
        yield
    finally:
        del loop.submit
        for request in held:
            loop.submit(request)
    assert held, "no committed request reached the decode loop's submit"


async def _completion(
    client: DecodeClient, request_id: str, sampling: SamplingParams, share_key: str
) -> tuple[Prefilled, decode_pb2.Lease]:
    prefilled = client.local.prefill(request_id, PROMPT, sampling)
    try:
        lease = await client.allocate(prefilled, share_key=share_key)
        await client.sync(prefilled, lease)
    finally:
        client.local.free(prefilled)
    return prefilled, lease


async def _sync_error(client: DecodeClient, prefilled: Prefilled, lease: decode_pb2.Lease):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await client.sync(prefilled, lease)
    return errors.from_rpc_error(caught.value)


@pytest.mark.parametrize("seeds", [(None, None), (7, 8)], ids=["greedy", "seeded"])
async def test_a_second_completion_shares_the_prompt_and_decodes_the_same_tokens(
    client: DecodeClient, seeds: tuple[int | None, int | None]
) -> None:
    servicer = client.instance.servicer
    with admissions_held(client):
        first, first_lease = await _completion(client, "r-0", _sampling(seeds[0]), "r:k")
        assert first_lease.num_shared_blocks == 0
        first_bytes = servicer.num_kv_bytes_received
        second, second_lease = await _completion(client, "r-1", _sampling(seeds[1]), "r:k")
        second_bytes = servicer.num_kv_bytes_received - first_bytes
    assert second_lease.num_shared_blocks == NUM_FULL
    assert list(second_lease.block_ids[:NUM_FULL]) == list(first_lease.block_ids[:NUM_FULL])
    # Only the partial block travelled: a third of the prompt's three blocks.
    assert second_bytes * 3 == first_bytes
    outputs = await asyncio.gather(
        client.collect(first_lease.lease_id, "r-0"), client.collect(second_lease.lease_id, "r-1")
    )
    for prefilled, messages, seed in zip((first, second), outputs, seeds, strict=True):
        ids, _ = tokens_of(messages)
        assert [prefilled.first_token_id, *ids] == client.local.reference(PROMPT, _sampling(seed))
    assert client.instance.leases.num_shared_blocks == NUM_FULL
    await client.assert_whole()


async def test_an_allocation_waits_for_its_siblings_kv_to_share_it(client: DecodeClient) -> None:
    first = client.local.prefill("w-0", PROMPT, _sampling(None))
    second = client.local.prefill("w-1", PROMPT, _sampling(None))
    try:
        first_lease = await client.allocate(first, share_key="w:k")
        asking = asyncio.ensure_future(client.allocate(second, share_key="w:k"))
        await asyncio.sleep(0.2)
        assert not asking.done()  # waiting for the first one's commit
        await client.sync(first, first_lease)
        second_lease = await asking
        assert second_lease.num_shared_blocks == NUM_FULL
        await client.sync(second, second_lease)
    finally:
        client.local.free(first)
        client.local.free(second)
    for lease, request_id in ((first_lease, "w-0"), (second_lease, "w-1")):
        ids, _ = tokens_of(await client.collect(lease.lease_id, request_id))
        assert len(ids) == 15
    await client.assert_whole()


async def test_a_transfer_into_a_shared_block_fails_and_leaves_the_sibling_whole(
    client: DecodeClient,
) -> None:
    with admissions_held(client):
        first, first_lease = await _completion(client, "x-0", _sampling(None), "x:k")
        second = client.local.prefill("x-1", PROMPT, _sampling(None))
        try:
            lease = await client.allocate(second, share_key="x:k")
            assert lease.num_shared_blocks == NUM_FULL
            # A sender that ignores num_shared_blocks writes the prompt's first block again.
            everything = decode_pb2.Lease()
            everything.CopyFrom(lease)
            everything.num_shared_blocks = 0
            error = await _sync_error(client, second, everything)
        finally:
            client.local.free(second)
    assert error.reason is ErrorReason.CACHE_SYNC_FAILED
    assert "shared blocks" in error.message
    ids, _ = tokens_of(await client.collect(first_lease.lease_id, "x-0"))
    assert [first.first_token_id, *ids] == client.local.reference(PROMPT, _sampling(None))
    await client.assert_whole()


async def test_a_share_key_naming_another_prompt_fails_the_transfer(client: DecodeClient) -> None:
    with admissions_held(client):
        _, first_lease = await _completion(client, "y-0", _sampling(None), "y:k")
        other = client.local.prefill("y-1", [6, *PROMPT[1:]], _sampling(None))
        try:
            lease = await client.allocate(other, share_key="y:k")
            assert lease.num_shared_blocks == NUM_FULL
            error = await _sync_error(client, other, lease)
        finally:
            client.local.free(other)
    assert error.reason is ErrorReason.CACHE_SYNC_FAILED
    assert "differ" in error.message
    await client.collect(first_lease.lease_id, "y-0")
    await client.assert_whole()
