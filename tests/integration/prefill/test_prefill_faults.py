"""Slow, refusing, unreachable and corrupting peers; aborts at every stage; nothing leaks."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch
from support.eventually import eventually
from support.prefill_cluster import Cluster, Delay, Events, cluster

from pdserve.common import env
from pdserve.common.errors import ErrorReason, RetryScope
from pdserve.common.generation import SamplingParams
from pdserve.engine.batch import ScheduledChunk
from pdserve.engine.colocated import LLMEngine
from pdserve.prefill.request import RequestStatus
from pdserve.v1 import prefill_pb2

PROMPT = [5, 17, 42, 99, 7, 63, 120, 33, 8, 250, 11]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


async def _wait_status(pd: Cluster, request_id: str, status: RequestStatus) -> None:
    deadline = time.monotonic() + 10
    while True:
        flight = pd.prefill.handoffs.live.get(request_id)
        if flight is not None and flight.request.status is status:
            return
        assert time.monotonic() < deadline, f"{request_id} never reached {status.name}"
        await asyncio.sleep(0.005)


async def _abort(pd: Cluster, request_id: str) -> None:
    reply = await pd.stub.AbortRequest(prefill_pb2.AbortRequestRequest(request_id=request_id))
    assert reply.was_known


def _expect(events: Events, reason: ErrorReason) -> None:
    assert events.error is not None, events.kinds
    assert events.error.reason is reason, events.error


async def test_a_slow_decode_delays_only_its_own_requests(
    tiny_model_dir: Path, engine: LLMEngine
) -> None:
    held = asyncio.Event()
    slow = Delay("AllocateBlocks", 0.0, gate=held)
    async with cluster(
        tiny_model_dir,
        num_decodes=2,
        decode_interceptors=[[], [slow]],
        prepare_concurrency=2,
        allocate_timeout_ms=10_000,
    ) as pd:
        # The slow decode's requests arrive first and fill its preparation slots (and more);
        # its AllocateBlocks answers only once the healthy decode's requests are done.
        to_slow = [
            asyncio.create_task(pd.run_prefill(pd.request(f"slow-{i}", PROMPT, GREEDY, decode=1)))
            for i in range(3)
        ]
        await eventually(lambda: slow.num_calls >= 2, what="the slow decode's slots taken")
        fast = await asyncio.gather(
            *(pd.complete(f"fast-{i}", PROMPT[i:], GREEDY, decode=0) for i in range(4))
        )
        assert fast == [engine.generate([PROMPT[i:]], GREEDY)[0] for i in range(4)]
        assert not any(t.done() for t in to_slow)
        held.set()
        slow_events = await asyncio.gather(*to_slow)
        assert all(e.kinds == ["first_token", "handed_off"] for e in slow_events)
        for events in slow_events:
            ids, _ = await pd.generate(events.last("handed_off").handed_off.lease_id, decode=1)
            assert [events.messages[0].first_token.token_id, *ids] == engine.generate(
                [PROMPT], GREEDY
            )[0]
        await pd.assert_whole()


async def test_decode_capacity_refusal_is_typed_and_leaks_nothing(tiny_model_dir: Path) -> None:
    async with cluster(tiny_model_dir, decode_blocks=8) as pd:
        events = await pd.run_prefill(pd.request("big", list(range(3, 43)), GREEDY))
        _expect(events, ErrorReason.DECODE_CAPACITY_EXHAUSTED)
        assert events.error is not None
        assert events.error.retry_scope is RetryScope.ANOTHER_DECODE
        assert events.error.retry_delay_s is not None and events.error.retry_delay_s > 0
        assert events.kinds == []
        await pd.assert_whole()


async def test_a_decode_that_does_not_answer_in_time_is_peer_unavailable(
    tiny_model_dir: Path,
) -> None:
    hang = Delay("AllocateBlocks", 1.0)
    async with cluster(tiny_model_dir, decode_interceptors=[[hang]], allocate_timeout_ms=200) as pd:
        events = await pd.run_prefill(pd.request("late", PROMPT, GREEDY))
        # NOTE: not waited out: a prefill that waited the 1 s would have had its lease
        _expect(events, ErrorReason.PEER_UNAVAILABLE)
        # A lease the decode grants after the deadline must be released too.
        await eventually(lambda: hang.num_ended == 1, what="the decode's call over")
        await pd.eventually_whole()


async def test_an_unreachable_decode_is_peer_unavailable(pd: Cluster) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    message = pd.request("nowhere", PROMPT, GREEDY)
    message.decode.address = f"127.0.0.1:{closed_port}"
    events = await pd.run_prefill(message)
    _expect(events, ErrorReason.PEER_UNAVAILABLE)
    await pd.assert_whole()


async def test_abort_while_preparing_releases_everything(tiny_model_dir: Path) -> None:
    held = asyncio.Event()
    slow = Delay("AllocateBlocks", 0.0, gate=held)
    async with cluster(tiny_model_dir, decode_interceptors=[[slow]]) as pd:
        stream = asyncio.create_task(pd.run_prefill(pd.request("prep", PROMPT, GREEDY)))
        await _wait_status(pd, "prep", RequestStatus.PREPARING)
        load = (await pd.prefill_pool()).load
        assert (load.num_queued_requests, load.num_queued_prompt_tokens) == (1, len(PROMPT))
        await _abort(pd, "prep")
        _expect(await stream, ErrorReason.CANCELLED)
        # A lease the decode grants after the abort must be released too.
        held.set()
        await eventually(lambda: slow.num_ended == 1, what="the decode's call over")
        await pd.eventually_whole()


class _SlowRunner:
    """Delegates to a runner, sleeping before every forward pass (a slow prefill)."""

    def __init__(self, runner: object, delay_s: float) -> None:
        self._runner = runner
        self.delay_s = delay_s

    def __getattr__(self, name: str) -> object:
        return getattr(self._runner, name)

    def execute(self, chunks: Sequence[ScheduledChunk], on_layer_done=None) -> torch.Tensor:  # type: ignore[no-untyped-def]
        time.sleep(self.delay_s)
        return self._runner.execute(chunks, on_layer_done)  # type: ignore[attr-defined]


async def test_abort_while_prefilling_releases_everything(tiny_model_dir: Path) -> None:
    async with cluster(tiny_model_dir) as pd:
        pd.prefill.loop.runner = _SlowRunner(pd.prefill.loop.runner, 0.1)  # type: ignore[assignment]
        long_prompt = list(range(3, 83))  # 5 passes of 16 tokens
        stream = asyncio.create_task(pd.run_prefill(pd.request("mid", long_prompt, GREEDY)))
        await _wait_status(pd, "mid", RequestStatus.PREFILLING)
        await asyncio.sleep(0.25)  # a pass or two in, KV of the first chunks already shipped
        assert (await pd.decode_pool()).pool.num_open_leases == 1
        await _abort(pd, "mid")
        events = await stream
        _expect(events, ErrorReason.CANCELLED)
        assert events.kinds == []
        # NOTE: the decode frees the lease's blocks once its transfer stream has ended, which
        # it learns shortly after the abort returned.
        await pd.eventually_whole()


async def test_abort_while_transferring_releases_everything(tiny_model_dir: Path) -> None:
    held = asyncio.Event()
    # NOTE: a gRPC interceptor: SyncCache transports only; the commit is held until released
    slow_commit = Delay("SyncCache", 0.0, gate=held)
    async with cluster(
        tiny_model_dir, decode_interceptors=[[slow_commit]], kv_transports="shm,grpc"
    ) as pd:
        stream = asyncio.create_task(pd.run_prefill(pd.request("xfer", PROMPT, GREEDY)))
        await _wait_status(pd, "xfer", RequestStatus.TRANSFERRING)
        await _abort(pd, "xfer")
        events = await stream
        assert events.kinds == ["first_token"]
        _expect(events, ErrorReason.CANCELLED)
        await pd.assert_whole()
        held.set()


@pytest.mark.parametrize(
    "stage",
    [RequestStatus.PREPARING, RequestStatus.TRANSFERRING],
    ids=["preparing", "transferring"],
)
async def test_a_caller_that_hangs_up_releases_everything(
    tiny_model_dir: Path, stage: RequestStatus
) -> None:
    held = asyncio.Event()
    slow = Delay(
        "AllocateBlocks" if stage is RequestStatus.PREPARING else "SyncCache", 0.0, gate=held
    )
    # NOTE: a gRPC interceptor: the SyncCache transports only
    async with cluster(
        tiny_model_dir, decode_interceptors=[[slow]], kv_transports="shm,grpc"
    ) as pd:
        call = pd.stub.Prefill(pd.request("gone", PROMPT, GREEDY))
        reader = asyncio.create_task(call.read())
        await _wait_status(pd, "gone", stage)
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await reader  # the first token, when it was already sent
        held.set()  # the decode answers only now, to a caller that is gone
        await eventually(lambda: slow.num_ended >= 1, what="the decode's late answer")
        await pd.eventually_whole()
        assert "gone" not in pd.prefill.handoffs.live


async def test_corrupted_kv_is_refused_by_the_decode_and_leaks_nothing(
    tiny_model_dir: Path, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(env.ENV_FAULT_CORRUPT_KV, "chaos-*")
    async with cluster(tiny_model_dir) as pd:
        events = await pd.run_prefill(pd.request("chaos-1", PROMPT, GREEDY))
        _expect(events, ErrorReason.CACHE_SYNC_FAILED)
        assert events.error is not None
        assert events.error.code is grpc.StatusCode.DATA_LOSS
        assert events.error.retry_scope is RetryScope.WHOLE_REQUEST
        await pd.assert_whole()
        # Requests the pattern does not match are untouched.
        assert await pd.complete("calm-1", PROMPT, GREEDY) == engine.generate([PROMPT], GREEDY)[0]
        await pd.assert_whole()


def test_kv_corruption_is_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(env.ENV_FAULT_CORRUPT_KV, raising=False)
    assert env.fault_corrupt_kv() is None
    monkeypatch.setenv(env.ENV_FAULT_CORRUPT_KV, "  ")
    assert env.fault_corrupt_kv() is None
    monkeypatch.setenv(env.ENV_FAULT_CORRUPT_KV, "r-*")
    assert env.fault_corrupt_kv() == "r-*"


async def test_a_decode_other_than_the_one_named_gets_no_kv(tiny_model_dir: Path) -> None:
    syncs = Delay("SyncCache", 0.0)  # counts SyncCache calls
    async with cluster(tiny_model_dir, decode_interceptors=[[syncs]]) as pd:
        message = pd.request("elsewhere", PROMPT, GREEDY)
        message.decode.instance_id = "decode-the-gateway-chose"
        events = await pd.run_prefill(message)
        _expect(events, ErrorReason.PERMISSION_DENIED)
        assert events.error is not None and "decode-the-gateway-chose" in events.error.message
        assert events.kinds == [] and syncs.num_calls == 0
        # Its lease is released at once (the TTL is 10 s).
        assert pd.decodes[0].leases.num_granted == 1
        await pd.eventually_whole()


@pytest.mark.parametrize("transport", ["shm", "grpc"])
async def test_a_refused_transfer_releases_its_lease_with_the_token(
    tiny_model_dir: Path, transport: str
) -> None:
    async with cluster(tiny_model_dir, kv_transports=transport) as pd:
        # A decode on an mTLS plane refuses SyncCache from a caller without a certificate, and
        # lets it release the lease only with the lease's token. (The TCP data port takes the
        # token alone, by design: test_kv_transports.)
        pd.decodes[0].leases.is_insecure = False
        events = await pd.run_prefill(pd.request("refused", PROMPT, GREEDY))
        assert events.error is not None
        assert events.error.reason in (ErrorReason.PERMISSION_DENIED, ErrorReason.CACHE_SYNC_FAILED)
        assert pd.decodes[0].leases.num_access_refused >= 1
        await pd.eventually_whole()  # released, not left to the 10 s TTL


async def test_filters_that_leave_no_first_token_fail_that_request_alone(
    pd: Cluster, engine: LLMEngine
) -> None:
    """The only allowed id is a bad word: INVALID_REQUEST, its lease and blocks returned; a
    request in the same pass gets its tokens as alone."""
    stuck = replace(GREEDY, allowed_token_ids=(5,), bad_words=((5,),))
    short = PROMPT[:5]
    expected = engine.generate([short[::-1]], GREEDY)[0]
    failed, tokens = await asyncio.gather(
        pd.run_prefill(pd.request("stuck", short, stuck)),
        pd.complete("beside", short[::-1], GREEDY),
    )
    _expect(failed, ErrorReason.INVALID_REQUEST)
    assert failed.kinds == [] and failed.error is not None
    assert "no token may come next" in failed.error.message
    assert tokens == expected
    await pd.eventually_whole()
