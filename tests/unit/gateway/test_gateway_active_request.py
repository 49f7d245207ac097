"""The one object a request is while the gateway runs it: its deadline, its continuation across
attempts, and its end; the orchestrator advances that same object."""

from __future__ import annotations

import asyncio

import pytest
from support.memory_backend import preempt
from support.memory_cluster import PROMPT_IDS, MemoryCluster, expected

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import FinishReason, SamplingParams
from pdserve.gateway.active_request import ActiveRequest
from pdserve.gateway.fleet.backend import FinishedEvent
from pdserve.gateway.request import GenerationEnd, GenerationRequest, TokenChunk


def _request(max_tokens: int = 4) -> GenerationRequest:
    sampling = SamplingParams(seed=3, max_tokens=max_tokens, prompt_logprobs=2)
    return GenerationRequest("r-1", "tiny", (1, 2, 3), sampling)


async def test_the_deadline_bounds_what_is_left() -> None:
    now = asyncio.get_running_loop().time()
    assert 0 < ActiveRequest(_request(), now + 5).remaining_s() <= 5
    with pytest.raises(PdserveError) as raised:
        ActiveRequest(_request(), now - 0.001).remaining_s()
    assert raised.value.reason is ErrorReason.DEADLINE_EXCEEDED
    assert raised.value.metadata == {"requestId": "r-1"}


def test_a_continuation_carries_the_delivered_tokens_but_not_the_prompt_logprobs() -> None:
    active = ActiveRequest(_request(), deadline=0.0)
    assert active.is_new and active.progress.continuation_token_ids() == (1, 2, 3)
    assert active.continuation_sampling() == active.request.sampling
    active.progress.accept([7, 8], 0)
    assert not active.is_new
    assert active.progress.continuation_token_ids() == (1, 2, 3, 7, 8)
    sampling = active.continuation_sampling()
    assert sampling.prompt_logprobs is None and sampling.seed == 3


def test_the_end_counts_the_attempts_and_prefers_the_gateways_own_finish_reason() -> None:
    active = ActiveRequest(_request(max_tokens=2), deadline=0.0)
    assert [active.start_attempt(), active.start_attempt()] == [1, 2]
    assert active.end().finish_reason is FinishReason.STOP  # nothing said why: a stop
    active.progress.accept([7], 0)
    assert active.end(FinishedEvent(FinishReason.ABORT)).finish_reason is FinishReason.ABORT
    active.progress.accept([8], 1)  # max_tokens: the gateway saw the end itself
    assert active.end(FinishedEvent(FinishReason.STOP, 2, 3)) == GenerationEnd(
        FinishReason.LENGTH, 2, num_cached_prompt_tokens=3, num_attempts=2
    )


def test_queue_waits_count_in_the_time_to_first_token_only_before_it() -> None:
    active = ActiveRequest(_request(), deadline=0.0)
    active.on_queue_wait(0.5)
    active.timeline.on_first_token(None)
    active.on_queue_wait(0.25)
    assert (active.queued_s, active.timeline.queue_wait_s) == (0.75, 0.5)
    assert active.end().queued_s == 0.75  # what its request_finished line says


async def test_the_orchestrator_advances_the_one_request_object() -> None:
    cluster = MemoryCluster()
    prefill, decode = cluster.add_prefill(), cluster.add_decode()
    decode.script = [preempt(after=3)]
    request = cluster.request(prompt_logprobs=1)
    deadline = asyncio.get_running_loop().time() + 5.0
    active = ActiveRequest(request, deadline)
    chunks = [event async for event in cluster.orchestrator.run(active)]
    await cluster.orchestrator.wait_for_cleanups()
    delivered = [t for chunk in chunks if isinstance(chunk, TokenChunk) for t in chunk.token_ids]
    assert list(active.progress.token_ids) == delivered == expected(request)
    assert (active.state.num_attempts, active.state.num_reschedules) == (2, 1)
    # The second attempt continued from what the first delivered, without prompt logprobs.
    first, second = prefill.calls
    assert first.token_ids == PROMPT_IDS and first.sampling.prompt_logprobs == 1
    assert second.token_ids == (*PROMPT_IDS, *delivered[:4])
    assert second.sampling.prompt_logprobs is None
