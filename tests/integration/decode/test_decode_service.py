"""Black-box tests of a real decode server over gRPC, fed with real KV from the engine."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import grpc
import pytest
from support.decode_harness import BLOCK_SIZE, DecodeClient, tokens_of
from support.eventually import eventually
from support.held_runner import HeldRunner

from pdserve.common import errors
from pdserve.common.errors import ErrorReason
from pdserve.common.generation import SamplingParams
from pdserve.decode.config import DecodeConfig
from pdserve.serving.convert import local_protocol
from pdserve.v1 import common_pb2, decode_pb2

PROMPT = [5, 17, 42, 99, 7, 63, 120, 33, 8, 250, 11]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


async def _handoff(client: DecodeClient, request_id: str, prompt: list[int], sampling):
    prefilled = client.local.prefill(request_id, prompt, sampling)
    try:
        lease = await client.allocate(prefilled)
        await client.sync(prefilled, lease)
    finally:
        client.local.free(prefilled)
    return prefilled, lease


async def _expect_error(awaitable, reason: ErrorReason) -> errors.PdserveError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await awaitable
    error = errors.from_rpc_error(caught.value)
    assert error.reason is reason, error
    return error


@pytest.mark.parametrize(
    "sampling",
    [GREEDY, SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True)],
    ids=["greedy", "seeded"],
)
async def test_handoff_generates_the_single_process_tokens(
    client: DecodeClient, sampling: SamplingParams
) -> None:
    reference = client.local.reference(PROMPT, sampling)
    prefilled, lease = await _handoff(client, "r1", PROMPT, sampling)
    messages = await client.collect(lease.lease_id, "r1")
    ids, indices = tokens_of(messages)
    assert [prefilled.first_token_id, *ids] == reference
    assert indices == list(range(1, sampling.max_tokens))
    kind, finished = messages[-1]  # type: ignore[misc]
    assert kind == "finished"
    assert finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert finished.usage.num_completion_tokens == sampling.max_tokens
    assert finished.usage.num_prompt_tokens == len(PROMPT)
    await client.assert_whole()


async def test_generate_may_attach_before_the_commit(client: DecodeClient) -> None:
    reference = client.local.reference(PROMPT, GREEDY)
    prefilled = client.local.prefill("early", PROMPT, GREEDY)
    lease = await client.allocate(prefilled)
    stream = asyncio.create_task(client.collect(lease.lease_id))
    await asyncio.sleep(0.2)
    assert not stream.done()
    await client.sync(prefilled, lease)
    client.local.free(prefilled)
    ids, _ = tokens_of(await stream)
    assert [prefilled.first_token_id, *ids] == reference
    await client.assert_whole()


async def test_capacity_exhausted_is_typed_with_retry_delay(client: DecodeClient) -> None:
    long_prompt = list(range(3, 3 + 60 * BLOCK_SIZE))  # 60 of the 64 blocks, plus headroom
    prefilled = client.local.prefill("big", long_prompt[:40], GREEDY)
    request = decode_pb2.AllocateBlocksRequest(
        request_id="big",
        num_prompt_tokens=len(long_prompt) + 10 * BLOCK_SIZE,
        max_new_tokens=8,
        kv_layout=client.local.host.kv_layout,
        protocol=local_protocol(),
    )
    error = await _expect_error(
        client.decode.AllocateBlocks(request), ErrorReason.DECODE_CAPACITY_EXHAUSTED
    )
    assert error.retry_delay_s == pytest.approx(0.2)
    assert error.retry_scope is errors.RetryScope.ANOTHER_DECODE
    client.local.free(prefilled)
    await client.assert_whole()


@pytest.fixture
def decode_config() -> DecodeConfig:
    return DecodeConfig(
        port=0, block_size=BLOCK_SIZE, num_blocks=64, lease_ttl_ms=1500, insecure=True
    )


async def test_headroom_keeps_running_requests_from_preemption(client: DecodeClient) -> None:
    # A running request holds 3 prompt blocks and is owed headroom for its next 32 tokens
    # (the default reserve_tokens), which covers all it may still generate. New admissions may
    # only use what is left, so however many arrive it is never preempted.
    sampling = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    # NOTE: its steps are held until the pool is filled: a runner that finished meanwhile (a
    # busy machine makes the fill slow) would free its blocks and headroom for more fillers.
    steps = threading.Event()
    client.instance.loop.runner = HeldRunner(client.instance.loop.runner, steps)  # type: ignore[assignment]
    _, lease = await _handoff(client, "runner", PROMPT, sampling)
    stream = asyncio.create_task(client.collect(lease.lease_id))
    status = await client.pool()
    assert status.insecure  # the harness runs with --insecure, and says so
    assert status.attention_backend == "sdpa"  # the CPU engine's attention, named to callers
    load = status.load
    assert load.num_reserved_blocks > 0
    available = load.num_free_blocks - load.num_reserved_blocks
    # Fill everything admission allows, in prompts of 8 blocks with no growth of their own.
    admitted = []
    while True:
        request = decode_pb2.AllocateBlocksRequest(
            request_id=f"filler{len(admitted)}",
            num_prompt_tokens=8 * BLOCK_SIZE,
            max_new_tokens=1,
            kv_layout=client.local.host.kv_layout,
            protocol=local_protocol(),
            prefill_instance_id=f"prefill-{len(admitted)}",  # each within its share
        )
        try:
            lease_id = (await client.decode.AllocateBlocks(request)).lease.lease_id
            admitted.append((lease_id, request.request_id))
        except grpc.aio.AioRpcError as error:
            assert errors.from_rpc_error(error).reason is ErrorReason.DECODE_CAPACITY_EXHAUSTED
            break
    steps.set()
    assert admitted and len(admitted) <= available // 9 + 1
    messages = await stream
    assert messages[-1][0] == "finished"  # type: ignore[index]
    assert all(m[0] != "preemption" for m in messages)  # type: ignore[index]
    for lease_id, request_id in admitted:
        await client.decode.ReleaseLease(
            decode_pb2.ReleaseLeaseRequest(lease_id=lease_id, request_id=request_id)
        )
    await client.assert_whole()


async def test_lease_expiry_reclaims_blocks(client: DecodeClient) -> None:
    prefilled = client.local.prefill("slow", PROMPT, GREEDY)
    client.local.free(prefilled)
    lease = await client.allocate(prefilled)
    assert (await client.pool()).pool.num_leased_blocks == len(lease.block_ids)
    # NOTE: TTL 1.5 s, sweep every 0.15 s.
    await eventually(
        lambda: client.instance.leases.table.num_expired == 1, 30, "the lease expiring"
    )
    await client.assert_whole()
    await _expect_error(client.collect(lease.lease_id), ErrorReason.LEASE_EXPIRED)
    assert client.instance.leases.table.num_expired == 1


async def test_release_is_idempotent_and_unknown_lease_is_not_found(client: DecodeClient) -> None:
    prefilled = client.local.prefill("rel", PROMPT, GREEDY)
    client.local.free(prefilled)
    lease = await client.allocate(prefilled)
    release = decode_pb2.ReleaseLeaseRequest(lease_id=lease.lease_id, request_id="rel")
    first = await client.decode.ReleaseLease(release)
    second = await client.decode.ReleaseLease(release)
    assert first.state == second.state == decode_pb2.LEASE_STATE_ABORTED
    unknown = await client.decode.ReleaseLease(decode_pb2.ReleaseLeaseRequest(lease_id="nope"))
    assert unknown.state == decode_pb2.LEASE_STATE_UNSPECIFIED
    await _expect_error(client.collect("nope"), ErrorReason.LEASE_NOT_FOUND)
    await client.assert_whole()


async def test_client_cancel_releases_a_running_lease(client: DecodeClient) -> None:
    sampling = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    _, lease = await _handoff(client, "cancel", PROMPT, sampling)
    call = client.decode.Generate(decode_pb2.DecodeServiceGenerateRequest(lease_id=lease.lease_id))
    await call.read()
    call.cancel()

    async def is_released() -> bool:
        return (await client.pool()).pool.num_open_leases == 0

    await eventually(is_released, 30, "the abandoned lease's release")
    await client.assert_whole()


def _corrupt(
    messages: list[decode_pb2.SyncCacheRequest], how: str
) -> list[decode_pb2.SyncCacheRequest]:
    chunks = [i for i, m in enumerate(messages) if m.WhichOneof("part") == "chunk"]
    if how == "flip":
        message = messages[chunks[3]]
        key = bytearray(message.chunk.key)
        key[17] ^= 0x01
        message.chunk.key = bytes(key)
    elif how == "missing":
        del messages[chunks[2]]
        commit = messages[-1].commit
        commit.num_chunks -= 1  # a consistent commit over an incomplete cache
        commit.num_bytes = sum(
            len(m.chunk.key) + len(m.chunk.value)
            for m in messages
            if m.WhichOneof("part") == "chunk"
        )
    elif how == "short_commit":
        messages[-1].commit.num_chunks += 1
    elif how == "cut":
        del messages[chunks[-1] :]
    return messages


@pytest.mark.parametrize("how", ["flip", "missing", "short_commit", "cut"])
async def test_bad_transfer_fails_and_frees_blocks(client: DecodeClient, how: str) -> None:
    prefilled = client.local.prefill(f"bad-{how}", PROMPT, GREEDY)
    lease = await client.allocate(prefilled)
    messages = _corrupt(list(client.local.sync_messages(prefilled, lease)), how)
    client.local.free(prefilled)
    waiting = asyncio.create_task(client.collect(lease.lease_id))
    error = await _expect_error(
        client.decode.SyncCache(iter(messages)), ErrorReason.CACHE_SYNC_FAILED
    )
    expected = grpc.StatusCode.ABORTED if how == "cut" else grpc.StatusCode.DATA_LOSS
    assert error.code == expected
    # A Generate that attached early learns the request will never decode.
    await _expect_error(waiting, ErrorReason.CACHE_SYNC_FAILED)
    await client.assert_whole()


async def test_stream_broken_by_the_sender_frees_blocks(client: DecodeClient) -> None:
    prefilled = client.local.prefill("broken", PROMPT, GREEDY)
    lease = await client.allocate(prefilled)
    messages = list(client.local.sync_messages(prefilled, lease))
    client.local.free(prefilled)

    never = asyncio.Event()

    async def send_some_then_hang():
        for message in messages[:4]:
            yield message
        await never.wait()

    call = client.decode.SyncCache(send_some_then_hang())
    await asyncio.sleep(0.3)
    call.cancel()  # the sender goes away mid-transfer
    with pytest.raises(asyncio.CancelledError):
        await call
    for _ in range(100):
        if (await client.pool()).pool.num_open_leases == 0:
            break
        await asyncio.sleep(0.05)
    await client.assert_whole()


@pytest.mark.parametrize("what", ["major", "layout"])
async def test_incompatible_peer_is_refused(client: DecodeClient, what: str) -> None:
    layout = common_pb2.KvLayout()
    layout.CopyFrom(client.local.host.kv_layout)
    protocol = local_protocol()
    if what == "major":
        protocol.version = "2.0"
    else:
        layout.fingerprint = "0" * 64
    request = decode_pb2.AllocateBlocksRequest(
        request_id="x", num_prompt_tokens=8, max_new_tokens=4, kv_layout=layout, protocol=protocol
    )
    error = await _expect_error(
        client.decode.AllocateBlocks(request), ErrorReason.INCOMPATIBLE_PEER
    )
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION
    await client.assert_whole()


async def test_draining_refuses_new_leases(client: DecodeClient) -> None:
    client.instance.leases.is_draining = True
    prefilled = client.local.prefill("drain", PROMPT, GREEDY)
    client.local.free(prefilled)
    await _expect_error(client.allocate(prefilled), ErrorReason.INSTANCE_DRAINING)


class TestPreemption:
    @pytest.fixture
    def decode_config(self) -> DecodeConfig:
        # 24 blocks of 4 tokens; headroom 0 so admission packs the pool and growth preempts;
        # one client leases them all before committing any, so its share is the whole pool.
        return DecodeConfig(
            port=0,
            block_size=BLOCK_SIZE,
            num_blocks=24,
            reserve_tokens=0,
            lease_ttl_ms=20_000,
            max_lease_share=1.0,
            insecure=True,
        )

    async def test_preempted_streams_end_with_an_exact_notice(self, client: DecodeClient) -> None:
        sampling = dataclasses.replace(GREEDY, max_tokens=40)
        prompts = [[(7 * i + j) % 300 + 3 for j in range(9 + i)] for i in range(6)]
        references = [client.local.reference(p, sampling) for p in prompts]
        handoffs = []
        for i, prompt in enumerate(prompts):  # lease everything first: 20 of 24 blocks
            prefilled = client.local.prefill(f"p{i}", prompt, sampling)
            handoffs.append((prefilled, await client.allocate(prefilled)))
        for prefilled, lease in handoffs:
            await client.sync(prefilled, lease)
            client.local.free(prefilled)
        results = await asyncio.gather(
            *(client.collect(lease.lease_id, f"p{i}") for i, (_, lease) in enumerate(handoffs))
        )
        num_preempted = 0
        for (prefilled, _), messages, reference in zip(handoffs, results, references, strict=True):
            ids, indices = tokens_of(messages)
            delivered = [prefilled.first_token_id, *ids]
            assert indices == list(range(1, len(delivered)))
            assert delivered == reference[: len(delivered)]
            kind, last = messages[-1]  # type: ignore[misc]
            if kind == "preemption":
                num_preempted += 1
                assert last.reason == decode_pb2.PREEMPTION_REASON_OUT_OF_BLOCKS
                assert last.num_generated_tokens == len(delivered)
                assert list(last.generated_token_ids) == delivered
            else:
                assert kind == "finished" and delivered == reference
        assert num_preempted > 0
        await client.assert_whole()


async def test_a_stop_between_two_steps_applies_the_aborts_queued_before_it(
    client: DecodeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream cancelled while a step runs queues its abort; a stop then lands before the
    step ends. The loop applies the abort as it stops, so the blocks come back (it used to
    return at the stop with the abort dropped, the blocks held)."""
    sampling = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    _, lease = await _handoff(client, "stopped", PROMPT, sampling)
    call = client.decode.Generate(decode_pb2.DecodeServiceGenerateRequest(lease_id=lease.lease_id))
    await call.read()
    loop = client.instance.loop
    in_step, go_on = threading.Event(), threading.Event()
    execute = loop.runner.execute

    def held_step(chunks: list) -> object:
        in_step.set()
        go_on.wait(60)
        return execute(chunks)

    monkeypatch.setattr(loop.runner, "execute", held_step)
    assert await asyncio.to_thread(in_step.wait, 60)
    call.cancel()
    await eventually(lambda: bool(loop._aborts), 30, "the cancelled stream's abort")

    def release_the_step_once_stopping() -> None:
        deadline = time.monotonic() + 60
        while not loop._is_stopped and time.monotonic() < deadline:
            time.sleep(0.01)
        go_on.set()

    releaser = threading.Thread(target=release_the_step_once_stopping)
    releaser.start()
    await client.instance.stop(grace=0)
    releaser.join()
    assert not loop.is_running
    pool = client.instance.leases.table.pool
    assert pool.num_free_blocks == pool.num_blocks
    client.instance.leases.table.check_integrity()
