"""Resumable Generate streams (contract 1.9) on a real decode server fed with real KV.

A resumable request outlives its stream: it runs on detached, and a `resume` stream gets every
completion token from index 0, then the live ones, then the terminal event; `snapshot` peeks.
The decode's steps are slowed down so that a stream can break while its request still runs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from support.decode_harness import BLOCK_SIZE, DecodeClient
from support.eventually import eventually

from pdserve.common import errors
from pdserve.common.errors import ErrorReason
from pdserve.common.generation import SamplingParams
from pdserve.decode.config import DecodeConfig
from pdserve.decode.lease_state import RequestStatus
from pdserve.decode.request import DecodeRequest
from pdserve.gateway.fleet.backend import (
    BackendError,
    DecodeCall,
    DecodeSnapshot,
    FinishedEvent,
    TokenBatchEvent,
)
from pdserve.gateway.fleet.clients import GrpcBackend
from pdserve.v1 import common_pb2, decode_pb2

PROMPT = [5, 17, 42, 99, 7, 63, 120, 33, 8, 250, 11]
SAMPLING = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
STEP_DELAY_S = 0.02  # per decode step: 32 tokens take about 0.6 s


@pytest.fixture
def decode_config(request: pytest.FixtureRequest) -> DecodeConfig:
    flags: dict[str, Any] = {"lease_ttl_ms": 5000, **getattr(request, "param", {})}
    return DecodeConfig(port=0, block_size=BLOCK_SIZE, num_blocks=64, insecure=True, **flags)


def _slow_down(client: DecodeClient) -> None:
    """Makes each decode step take at least STEP_DELAY_S (the server's own runner)."""
    runner = client.instance.loop.runner
    execute: Callable[..., Any] = runner.execute

    def slow_execute(*args: Any, **kwargs: Any) -> Any:
        time.sleep(STEP_DELAY_S)
        return execute(*args, **kwargs)

    runner.execute = slow_execute  # type: ignore[method-assign]


async def _running(client: DecodeClient, request_id: str) -> tuple[decode_pb2.Lease, list[int]]:
    """A committed request on the slowed decode, and the reference completion it must give."""
    _slow_down(client)
    reference = client.local.reference(PROMPT, SAMPLING)
    prefilled = client.local.prefill(request_id, PROMPT, SAMPLING)
    try:
        lease = await client.allocate(prefilled)
        await client.sync(prefilled, lease)
    finally:
        client.local.free(prefilled)
    return lease, reference


def _call(client: DecodeClient, lease: decode_pb2.Lease, **flags: bool) -> Any:
    request = decode_pb2.DecodeServiceGenerateRequest(
        request_id="r", lease_id=lease.lease_id, **flags
    )
    return client.decode.Generate(request)


async def _read(call: Any, num_messages: int) -> list[decode_pb2.DecodeServiceGenerateResponse]:
    messages = []
    async for message in call:
        messages.append(message)
        if len(messages) == num_messages:
            break
    return messages


async def _collect(call: Any) -> list[decode_pb2.DecodeServiceGenerateResponse]:
    return [message async for message in call]


def _tokens(messages: list[decode_pb2.DecodeServiceGenerateResponse]) -> tuple[list[int], int]:
    """Token ids in stream order; checks that each batch starts where the last one ended
    (no gap, no duplicate) and returns the first batch's first index."""
    ids: list[int] = []
    batches = [m.tokens for m in messages if m.WhichOneof("event") == "tokens"]
    first = batches[0].first_index if batches else 0
    for batch in batches:
        assert batch.first_index == first + len(ids), "a gap or a duplicate in the stream"
        ids.extend(batch.token_ids)
    return ids, first


def _detached_gauge(client: DecodeClient) -> float | None:
    registry = client.instance.metrics.registry
    return registry.get_sample_value("pdserve_decode_detached_requests")


def _request(client: DecodeClient, lease: decode_pb2.Lease) -> DecodeRequest:
    return client.instance.servicer.requests[lease.lease_id]


async def _cancel_after(client: DecodeClient, lease: decode_pb2.Lease, num: int) -> None:
    """Opens a resumable stream, reads `num` messages and hangs up (its gateway died)."""
    call = _call(client, lease, resumable=True)
    assert len(await _read(call, num)) == num
    call.cancel()


async def _expect_error(awaitable: Any, reason: ErrorReason) -> errors.PdserveError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await awaitable
    error = errors.from_rpc_error(caught.value)
    assert error.reason is reason, error
    return error


def _finished(message: decode_pb2.DecodeServiceGenerateResponse) -> common_pb2.Finished:
    assert message.WhichOneof("event") == "finished"
    return message.finished


async def test_a_broken_resumable_stream_runs_on_and_resume_gets_every_token(
    client: DecodeClient,
) -> None:
    lease, reference = await _running(client, "r")
    await _cancel_after(client, lease, 2)
    request = _request(client, lease)
    await eventually(lambda: request.is_detached, what="the request detached")
    assert request.status is RequestStatus.RUNNING  # still generating, nobody attached
    assert client.instance.servicer.kept.num_detached == 1
    assert _detached_gauge(client) == 1
    detached_at = request.num_generated_tokens
    await eventually(lambda: request.num_generated_tokens > detached_at + 2)
    messages = await _collect(_call(client, lease, resume=True))
    ids, first = _tokens(messages)
    assert (ids, first) == (reference, 0)
    assert len(messages[0].tokens.token_ids) >= detached_at  # the first batch: all so far
    assert _finished(messages[-1]).usage.num_completion_tokens == SAMPLING.max_tokens
    assert _detached_gauge(client) == 0
    await client.assert_whole()


@pytest.mark.parametrize("decode_config", [{"lease_ttl_ms": 300}], indirect=True)
async def test_a_detached_request_outlives_the_lease_ttl(client: DecodeClient) -> None:
    lease, reference = await _running(client, "r")  # runs about twice the TTL
    await _cancel_after(client, lease, 1)
    request = _request(client, lease)
    await eventually(lambda: request.events.terminal is not None, what="the request finished")
    assert request.status is RequestStatus.FINISHED  # not EXPIRED by the sweeper
    messages = await _collect(_call(client, lease, resume=True))
    assert _tokens(messages) == (reference, 0)
    _finished(messages[-1])
    await client.assert_whole()


async def test_resume_takes_over_an_attached_stream(client: DecodeClient) -> None:
    lease, reference = await _running(client, "r")
    first_call = _call(client, lease, resumable=True)
    await _read(first_call, 2)
    second = asyncio.create_task(_collect(_call(client, lease, resume=True)))
    error = await _expect_error(_collect(first_call), ErrorReason.CANCELLED)
    assert error.code is grpc.StatusCode.ABORTED
    assert error.metadata["takenOver"] == "true"
    messages = await second
    assert _tokens(messages) == (reference, 0)
    _finished(messages[-1])
    await client.assert_whole()


async def test_resume_after_the_end_replays_the_completion_and_finished(
    client: DecodeClient,
) -> None:
    lease, reference = await _running(client, "r")
    await _cancel_after(client, lease, 1)
    request = _request(client, lease)
    await eventually(lambda: request.events.terminal is not None, what="the request finished")
    messages = await _collect(_call(client, lease, resume=True))
    assert [m.WhichOneof("event") for m in messages] == ["tokens", "finished"]
    assert _tokens(messages) == (reference, 0)
    # NOTE: kept for a replay until the keep time passes; a second resume replays again.
    again = await _collect(_call(client, lease, resume=True))
    assert _tokens(again) == (reference, 0)
    await client.assert_whole()


async def test_snapshot_peeks_without_disturbing_the_stream(client: DecodeClient) -> None:
    lease, reference = await _running(client, "r")
    live = _call(client, lease, resumable=True)
    head = await _read(live, 3)
    peek = await _collect(_call(client, lease, snapshot=True))
    assert len(peek) == 1  # running: tokens only, no terminal event
    assert peek[0].tokens.first_index == 0
    assert list(peek[0].tokens.token_ids) == reference[: len(peek[0].tokens.token_ids)]
    rest = await _collect(live)
    ids, first = _tokens(head + rest)
    assert [reference[0], *ids] == reference and first == 1  # undisturbed
    assert not any(m.tokens.logprobs for m in rest if m.WhichOneof("event") == "tokens")
    after = await _collect(_call(client, lease, snapshot=True))
    assert [m.WhichOneof("event") for m in after] == ["tokens", "finished"]
    assert _tokens(after) == (reference, 0)
    await client.assert_whole()


async def test_resume_and_plain_generate_are_refused_where_they_do_not_apply(
    client: DecodeClient,
) -> None:
    lease, _ = await _running(client, "r")
    live = _call(client, lease)  # not resumable
    await _read(live, 1)
    await _expect_error(_collect(_call(client, lease, resume=True)), ErrorReason.INVALID_REQUEST)
    await _collect(live)
    await _expect_error(_collect(_call(client, lease, resume=True)), ErrorReason.LEASE_NOT_FOUND)
    other, _ = await _running(client, "r2")
    await _cancel_after(client, other, 1)
    await eventually(lambda: _request(client, other).is_detached)
    # A plain Generate on a request that had a stream would start mid-way: refused.
    await _expect_error(_collect(_call(client, other)), ErrorReason.INVALID_REQUEST)
    await _collect(_call(client, other, resume=True))
    await client.assert_whole()


@pytest.mark.parametrize("decode_config", [{"detached_keep_s": 0.3}], indirect=True)
async def test_a_detached_request_nobody_resumes_is_released(client: DecodeClient) -> None:
    lease, _ = await _running(client, "r")
    await _cancel_after(client, lease, 1)
    await eventually(
        lambda: lease.lease_id not in client.instance.servicer.requests,
        what="the detached request released",
    )
    await eventually(client.is_whole, what="every block free again")
    await _expect_error(_collect(_call(client, lease, resume=True)), ErrorReason.LEASE_NOT_FOUND)
    await client.assert_whole()


@pytest.mark.parametrize("decode_config", [{"max_detached_requests": 0}], indirect=True)
async def test_past_the_detached_limit_a_broken_stream_releases_at_once(
    client: DecodeClient,
) -> None:
    lease, _ = await _running(client, "r")
    await _cancel_after(client, lease, 1)
    await eventually(lambda: lease.lease_id not in client.instance.servicer.requests)
    await eventually(client.is_whole, what="every block free again")
    await _expect_error(_collect(_call(client, lease, resume=True)), ErrorReason.LEASE_NOT_FOUND)


async def test_the_gateways_grpc_client_resumes_and_takes_snapshots(client: DecodeClient) -> None:
    lease, reference = await _running(client, "r")
    backend = GrpcBackend()
    address = f"127.0.0.1:{client.instance.port}"
    try:
        stream = backend.generate(address, DecodeCall("r", lease.lease_id, resumable=True), 30.0)
        assert isinstance(await anext(stream), TokenBatchEvent)
        await stream.aclose()  # the gateway went away
        await eventually(lambda: _request(client, lease).is_detached)
        peek = await backend.snapshot(address, "r", lease.lease_id, 5.0)
        assert peek.end is None
        assert list(peek.token_ids) == reference[: len(peek.token_ids)]
        resume = DecodeCall("r", lease.lease_id, resume=True)
        events = [event async for event in backend.generate(address, resume, 30.0)]
        batches = [e for e in events if isinstance(e, TokenBatchEvent)]
        assert batches[0].first_index == 0
        assert [t for batch in batches for t in batch.token_ids] == reference
        assert isinstance(events[-1], FinishedEvent)
        after = await backend.snapshot(address, "r", lease.lease_id, 5.0)
        assert after == DecodeSnapshot(tuple(reference), events[-1])
        with pytest.raises(BackendError) as caught:
            await backend.snapshot(address, "r", "no-such-lease", 5.0)
        assert caught.value.error.reason is ErrorReason.LEASE_NOT_FOUND
    finally:
        await backend.close()
    await client.assert_whole()
