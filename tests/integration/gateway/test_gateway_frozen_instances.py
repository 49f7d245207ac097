"""Frozen instances: streams on an instance that stopped heartbeating move instead of hanging.

A frozen process keeps its connections open, so its streams neither yield nor fail. The
registry notices the missing heartbeats; the gateway then interrupts every stream that depends
on the instance and continues the request elsewhere, token for token. Here: the whole path over
gRPC with real heartbeats; the other cases (a decode or prefill frozen before the hand-off, a
decode that deregisters) run on the orchestrator in memory (test_gateway_orchestrator).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import pytest
from support.eventually import eventually
from support.gateway_cluster import Cluster
from support.gateway_fakes import MODEL_NAME, FakeInstance, expected_tokens, heartbeat

from pdserve.gateway.relay import InstanceLost, LossWatch, next_or_lost

PROMPT = "a frozen decode"
PROMPT_IDS = list(PROMPT.encode())
MAX_TOKENS = 24
TTL_S = 0.6
REQUEST_TIMEOUT_S = 20.0  # NOTE: the test gateway's (`support.gateway_cluster`)


@contextlib.asynccontextmanager
async def heartbeating(
    cluster: Cluster, *instances: FakeInstance, until: Callable[[FakeInstance], bool]
) -> AsyncIterator[None]:
    """Heartbeats every instance every 0.1 s, each until `until(instance)` holds."""

    async def beat() -> None:
        while True:
            for instance in instances:
                if not until(instance):
                    await heartbeat(cluster.internal_address, instance)
            await asyncio.sleep(0.1)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _stream(cluster: Cluster, seed: int) -> list[int]:
    stream = await cluster.openai().completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        seed=seed,
        stream=True,
        extra_body={"return_token_ids": True},
    )
    token_ids: list[int] = []
    async for chunk in stream:
        token_ids += chunk.choices[0].model_extra["token_ids"]
    return token_ids


async def _frozen_cluster(cluster: Cluster) -> tuple[FakeInstance, FakeInstance, FakeInstance]:
    await cluster.start_gateway(heartbeat_interval_s=0.1, instance_ttl_s=TTL_S)
    prefill = await cluster.add_prefill()
    # NOTE: more free blocks: the router picks the doomed decode first.
    doomed = await cluster.add_decode("decode-doomed", num_total_blocks=2000)
    survivor = await cluster.add_decode("decode-survivor", num_total_blocks=1000)
    return prefill, doomed, survivor


async def test_stream_on_a_frozen_decode_moves_to_the_other(cluster: Cluster) -> None:
    prefill, doomed, survivor = await _frozen_cluster(cluster)
    doomed.knobs.pause_after = 4  # the stream stalls with its connection open, for good
    started = time.monotonic()
    async with heartbeating(cluster, prefill, doomed, survivor, until=lambda i: i.paused.is_set()):
        token_ids = await _stream(cluster, seed=31)
    assert token_ids == expected_tokens(PROMPT_IDS, 31, MAX_TOKENS)
    # Moved after the TTL (plus one sweep), not at the 20 s request timeout (which fails it).
    assert time.monotonic() - started < REQUEST_TIMEOUT_S
    assert cluster.gateway is not None
    assert cluster.gateway.metrics.count("reschedules", "decode_lost") == 1
    assert cluster.gateway.metrics.count("instances_lost", "decode") == 1
    assert len(survivor.generate_calls) == 1
    assert cluster.gateway.registry.get("decode-doomed") is None
    # The interrupted Generate was cancelled, which releases the frozen decode's lease.
    await eventually(lambda: doomed.num_open_leases == 0)
    assert cluster.gateway.orchestrator.loss_watch.num_watchers == 0


# ---- next_or_lost ------------------------------------------------------------------------------


async def _stalling_stream(closed: list[bool], stalled: asyncio.Event) -> AsyncIterator[int]:
    try:
        yield 1
        stalled.set()
        await asyncio.Event().wait()  # forever
        yield 2
    finally:
        closed.append(True)


async def test_next_or_lost_relays_until_the_instance_is_lost() -> None:
    watch, closed, stalled = LossWatch(), [], asyncio.Event()
    stream = _stalling_stream(closed, stalled)
    with watch.watching(("d1", "p1")) as lost:
        assert await next_or_lost(stream, lost) == 1
        pending = asyncio.create_task(next_or_lost(stream, lost))
        await stalled.wait()
        watch.notify("p2")  # another instance: nothing happens
        # NOTE: a check that nothing happens has no condition to wait for: give it a moment.
        await asyncio.sleep(0.01)
        assert not pending.done()
        watch.notify("d1")
        with pytest.raises(InstanceLost) as raised:
            await asyncio.wait_for(pending, 30)
        assert raised.value.instance_id == "d1"
        assert closed == [True]  # the stalled step was cancelled and the stream unwound
        with pytest.raises(InstanceLost):
            await next_or_lost(stream, lost)
    assert watch.num_watchers == 0


async def test_next_or_lost_ends_with_the_stream() -> None:
    async def two() -> AsyncIterator[int]:
        yield 1
        yield 2

    watch, stream = LossWatch(), two()
    with watch.watching(("d1",)) as lost:
        assert [await next_or_lost(stream, lost), await next_or_lost(stream, lost)] == [1, 2]
        with pytest.raises(StopAsyncIteration):
            await next_or_lost(stream, lost)


async def test_next_or_lost_cancelled_caller_unwinds_the_stream() -> None:
    watch, closed = LossWatch(), []
    stream = _stalling_stream(closed, asyncio.Event())
    with watch.watching(("d1",)) as lost:
        assert await next_or_lost(stream, lost) == 1
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await next_or_lost(stream, lost)
    assert closed == [True]


async def test_a_loss_right_after_a_step_leaves_the_caller_running() -> None:
    gate: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def gated() -> AsyncIterator[int]:
        yield await gate

    watch, stream = LossWatch(), gated()
    with watch.watching(("d1",)) as lost:

        async def caller() -> int:
            value = await next_or_lost(stream, lost)
            await asyncio.sleep(0.01)  # the caller's own work after the step
            return value

        pending = asyncio.create_task(caller())
        await asyncio.sleep(0)
        # NOTE: both in one turn: the step returns first, the loss callback runs after it.
        gate.set_result(1)
        watch.notify("d1")
        assert await asyncio.wait_for(pending, 30) == 1
