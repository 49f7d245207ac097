"""A real prefill server handing off to a real decode server, against the single-process engine."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from support.prefill_cluster import BLOCK_SIZE, Cluster, Delay, cluster

from pdserve.common import errors
from pdserve.common.errors import ErrorReason
from pdserve.common.generation import SamplingParams, num_blocks_for
from pdserve.engine.colocated import LLMEngine
from pdserve.v1 import common_pb2, decode_pb2, prefill_pb2

SHORT = [5, 17, 42, 99, 7, 63, 120, 33, 8, 250, 11]
LONG = [(13 * i + 5) % 310 + 3 for i in range(53)]  # > 3 token budgets of 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["short", "chunked"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_prefill_then_decode_equals_the_single_process_engine(
    pd: Cluster, engine: LLMEngine, prompt: list[int], sampling: SamplingParams
) -> None:
    reference = engine.generate([prompt], sampling)[0]
    assert await pd.complete("r", prompt, sampling) == reference
    await pd.assert_whole()


async def test_concurrent_requests_share_passes_and_each_equals_the_engine(
    pd: Cluster, engine: LLMEngine
) -> None:
    prompts = [SHORT, LONG, SHORT[:4], LONG[:30], [9] * 17, LONG[::-1], SHORT * 3]
    samplings = [
        SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=8, ignore_eos=True)
        for i in range(len(prompts))
    ]
    references = [engine.generate([p], s)[0] for p, s in zip(prompts, samplings, strict=True)]
    results = await asyncio.gather(
        *(
            pd.complete(f"batch-{i}", p, s)
            for i, (p, s) in enumerate(zip(prompts, samplings, strict=True))
        )
    )
    assert results == references
    # Shared passes: fewer than one pass per budget-sized piece of each prompt.
    one_by_one = sum(num_blocks_for(len(p), 16) for p in prompts)
    assert pd.prefill.loop.num_passes < one_by_one
    await pd.assert_whole()


async def test_rescheduled_request_continues_where_it_stopped(
    pd: Cluster, engine: LLMEngine
) -> None:
    sampling = SamplingParams(temperature=0.7, seed=5, max_tokens=10, ignore_eos=True)
    reference = engine.generate([SHORT], sampling)[0]
    earlier = reference[:4]
    continuation = await pd.complete(
        "again", [*SHORT, *earlier], sampling, num_prompt_tokens=len(SHORT)
    )
    assert continuation == reference[4:]
    await pd.assert_whole()


async def test_first_token_arrives_before_the_transfer_is_acknowledged(
    tiny_model_dir: Path, engine: LLMEngine
) -> None:
    held = asyncio.Event()
    # NOTE: a gRPC interceptor: SyncCache transports only. The decode holds the transfer's
    # stream (and so its acknowledgement) until the test has the first token.
    slow_commit = Delay("SyncCache", 0.0, gate=held)
    async with cluster(
        tiny_model_dir, decode_interceptors=[[slow_commit]], kv_transports="shm,grpc"
    ) as pd:
        call = pd.stub.Prefill(pd.request("r", SHORT, GREEDY))
        first = await call.read()
        assert first.WhichOneof("event") == "first_token"
        assert first.first_token.token_id == engine.generate([SHORT], GREEDY)[0][0]
        assert slow_commit.num_ended == 0  # the acknowledgement still held
        held.set()
        second = await call.read()
        assert second.WhichOneof("event") == "handed_off"
        assert await call.read() is grpc.aio.EOF
        handed_off = second.handed_off
        assert handed_off.decode_instance_id == pd.decodes[0].status.instance.instance_id
        assert handed_off.num_chunks > 0
        num_blocks = num_blocks_for(len(SHORT), BLOCK_SIZE)
        layout = pd.prefill.host.runner.kv_cache.layout
        assert handed_off.num_bytes == 2 * num_blocks * layout.num_layers * layout.block_nbytes
        ids, _ = await pd.generate(handed_off.lease_id)
        assert len(ids) == GREEDY.max_tokens - 1
        await pd.assert_whole()


async def test_a_stop_token_first_finishes_on_the_prefill_and_releases_the_lease(
    pd: Cluster, engine: LLMEngine
) -> None:
    first = engine.generate([LONG], GREEDY)[0][0]
    sampling = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(first,))
    events = await pd.run_prefill(pd.request("stop", LONG, sampling))
    assert events.error is None
    assert events.kinds == ["first_token", "finished"]
    finished = events.messages[1].finished
    assert finished.finish_reason == common_pb2.FINISH_REASON_STOP
    assert (finished.usage.num_prompt_tokens, finished.usage.num_completion_tokens) == (
        len(LONG),
        1,
    )
    # NOTE: the lease was released before `finished` was sent; the decode frees its blocks once
    # the transfer stream that was writing into them has ended too (a moment later).
    await pd.eventually_whole()


async def test_max_tokens_reached_by_the_first_token_takes_no_lease(
    tiny_model_dir: Path, engine: LLMEngine
) -> None:
    counter = Delay("AllocateBlocks", 0.0)
    async with cluster(tiny_model_dir, decode_interceptors=[[counter]]) as pd:
        # A rescheduled request with one token left: index 2 of max_tokens 3.
        sampling = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        reference = engine.generate([SHORT], sampling)[0]
        message = pd.request(
            "last", [*SHORT, *reference[:2]], sampling, num_prompt_tokens=len(SHORT)
        )
        events = await pd.run_prefill(message)
        assert events.kinds == ["first_token", "finished"]
        assert events.messages[0].first_token.token_id == reference[2]
        assert events.messages[0].first_token.index == 2
        finished = events.messages[1].finished
        assert finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert finished.usage.num_completion_tokens == 3
        assert counter.num_calls == 0
        await pd.assert_whole()


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"token_ids": []}, ErrorReason.INVALID_REQUEST),
        ({"token_ids": [5, 100_000]}, ErrorReason.INVALID_REQUEST),
        ({"decode": prefill_pb2.DecodeTarget()}, ErrorReason.INVALID_REQUEST),
        ({"num_prompt_tokens": 99}, ErrorReason.INVALID_REQUEST),
        ({"token_ids": list(range(3, 300))}, ErrorReason.PROMPT_TOO_LONG),
        ({"protocol": common_pb2.Protocol(version="2.0")}, ErrorReason.INCOMPATIBLE_PEER),
    ],
    ids=["empty", "out-of-vocab", "no-decode", "prompt-length", "too-long", "protocol"],
)
async def test_bad_requests_get_typed_errors(
    pd: Cluster, change: dict[str, object], reason: ErrorReason
) -> None:
    message = pd.request("bad", SHORT, GREEDY)
    for name, value in change.items():
        message.ClearField(name)  # type: ignore[arg-type]
        if isinstance(value, list):
            getattr(message, name).extend(value)
        elif isinstance(value, int):
            setattr(message, name, value)
        else:
            getattr(message, name).CopyFrom(value)
    events = await pd.run_prefill(message)
    assert events.error is not None and events.error.reason is reason, events.error
    await pd.assert_whole()


async def test_sampling_that_already_reached_max_tokens_is_invalid(pd: Cluster) -> None:
    message = pd.request("done", [*SHORT, 7, 8], GREEDY, num_prompt_tokens=len(SHORT))
    message.sampling.max_tokens = 2
    events = await pd.run_prefill(message)
    assert events.error is not None and events.error.reason is ErrorReason.INVALID_REQUEST


async def test_overload_and_duplicate_ids_are_refused(tiny_model_dir: Path) -> None:
    held_open = asyncio.Event()
    slow = Delay("AllocateBlocks", 0.0, gate=held_open)  # the two requests held until released
    async with cluster(tiny_model_dir, decode_interceptors=[[slow]], max_queue_len=2) as pd:
        held = [
            asyncio.create_task(pd.run_prefill(pd.request(f"h{i}", SHORT, GREEDY)))
            for i in range(2)
        ]
        while len(pd.prefill.handoffs.live) < 2:
            await asyncio.sleep(0.01)
        overloaded = await pd.run_prefill(pd.request("one-more", SHORT, GREEDY))
        assert overloaded.error is not None
        assert overloaded.error.reason is ErrorReason.PREFILL_OVERLOADED
        assert overloaded.error.retry_scope is errors.RetryScope.ANOTHER_PREFILL
        duplicate = await pd.run_prefill(pd.request("h0", SHORT, GREEDY))
        assert duplicate.error is not None
        assert duplicate.error.reason is ErrorReason.INVALID_REQUEST
        # Nobody attaches: release the committed leases so the pools are whole again.
        held_open.set()
        for i, events in enumerate(await asyncio.gather(*held)):
            assert events.kinds == ["first_token", "handed_off"]
            lease_id = events.last("handed_off").handed_off.lease_id
            await pd.decode_stubs[0].ReleaseLease(
                decode_pb2.ReleaseLeaseRequest(lease_id=lease_id, request_id=f"h{i}")
            )
        await pd.eventually_whole()


async def test_model_info_and_status_describe_the_instance(pd: Cluster) -> None:
    info = await pd.stub.GetModelInfo(prefill_pb2.GetModelInfoRequest())
    host = pd.prefill.host
    assert info.model_name == host.served_model_name
    assert list(info.eos_token_ids) == list(host.eos_token_ids)
    assert info.max_model_len == host.max_model_len
    assert info.kv_layout.fingerprint == pd.decodes[0].host.kv_layout.fingerprint
    assert info.kv_layout.block_size == BLOCK_SIZE
    assert info.instance.role == common_pb2.INSTANCE_ROLE_PREFILL
    assert info.instance.address == f"127.0.0.1:{pd.prefill.port}"
    status = await pd.prefill_pool()
    assert status.instance == info.instance
    assert status.pool.num_total_blocks == 64
    assert status.load.num_total_blocks == 64


async def test_abort_of_an_unknown_request_is_a_no_op(pd: Cluster) -> None:
    response = await pd.stub.AbortRequest(prefill_pb2.AbortRequestRequest(request_id="nobody"))
    assert not response.was_known


async def test_health_reports_serving(pd: Cluster) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = grpc.aio.insecure_channel(f"127.0.0.1:{pd.prefill.port}")
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="pdserve.v1.PrefillService")
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await channel.close()


async def test_requests_beyond_the_prefill_pool_wait_for_blocks(
    tiny_model_dir: Path, engine: LLMEngine
) -> None:
    # 8 blocks hold one 24-token prompt (6 blocks) at a time; the others wait for its release.
    async with cluster(tiny_model_dir, num_blocks=8, max_num_batched_tokens=64) as pd:
        prompts = [[(i * 31 + j) % 300 + 3 for j in range(24)] for i in range(3)]
        results = await asyncio.gather(
            *(pd.complete(f"w{i}", p, GREEDY) for i, p in enumerate(prompts))
        )
        assert results == [engine.generate([p], GREEDY)[0] for p in prompts]
        await pd.assert_whole()
