"""The orchestrator over scripted in-memory instances: the consumer sees the undisturbed
completion, each index exactly once, or a typed error; every attempt left early gives back what
it held (AbortRequest before the hand-off, ReleaseLease after)."""

from __future__ import annotations

import asyncio

import pytest
from support.eventually import eventually
from support.gateway_fakes import BLOCK_SIZE
from support.memory_backend import (
    Fault,
    MemoryInstance,
    end,
    fail,
    lose,
    preempt,
    repeat,
    skip,
    stall,
)
from support.memory_cluster import PROMPT_IDS, MemoryCluster, expected

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import FinishReason
from pdserve.gateway.fleet.instance import LoadReport
from pdserve.gateway.request import GenerationRequest, TokenChunk
from pdserve.gateway.routing.pools import lease_blocks
from pdserve.gateway.routing.queue_bounds import QueueLimits

R = ErrorReason
# NOTE: the decode's admissible blocks a default request's lease takes (its prompt and 24 new
# tokens, all within the headroom), in the fakes' blocks of 4 tokens.
LEASE_BLOCKS = lease_blocks(len(PROMPT_IDS), 24, BLOCK_SIZE)


@pytest.fixture
def cluster() -> MemoryCluster:
    return MemoryCluster()


def _pd(cluster: MemoryCluster) -> tuple[MemoryInstance, MemoryInstance]:
    return cluster.add_prefill(), cluster.add_decode()


def _continued_from(prefill: MemoryInstance) -> list[int]:
    """How many completion tokens each Prefill call on `prefill` continued from."""
    return [len(call.token_ids) - call.num_prompt_tokens for call in prefill.calls]


# ---- rescheduling ----------------------------------------------------------------------------


async def test_preempted_request_continues_without_dup_or_gap(cluster: MemoryCluster) -> None:
    prefill, decode = _pd(cluster)
    decode.script = [preempt(after=3), preempt(after=3)]
    request = cluster.request(seed=11)
    completion = await cluster.run(request)
    assert completion.token_ids == expected(request)
    assert completion.end.finish_reason is FinishReason.LENGTH
    counts = completion.end
    assert (counts.num_completion_tokens, counts.num_attempts, counts.num_reschedules) == (24, 3, 2)
    # Each continuation prefills prompt + every delivered token, with the same sampling.
    assert _continued_from(prefill) == [0, 4, 8]
    for call in prefill.calls:
        delivered = expected(request)[: len(call.token_ids) - len(PROMPT_IDS)]
        assert call.token_ids == (*PROMPT_IDS, *delivered)
        assert (call.num_prompt_tokens, call.sampling) == (len(PROMPT_IDS), request.sampling)
    assert cluster.metrics.count("reschedules", "preempted") == 2
    assert decode.num_open_leases == 0 and decode.released == []


async def test_preemption_avoids_the_decode_when_asked_but_falls_back_to_it() -> None:
    cluster = MemoryCluster(preempt_retry_exclude_decode=True)
    cluster.add_prefill()
    big, small = cluster.add_decode("decode-big", num_blocks=2000), cluster.add_decode()
    big.script = [preempt(after=2)]
    small.script = [preempt(after=2)]
    request = cluster.request()
    assert (await cluster.run(request)).token_ids == expected(request)
    # big preempts -> small (avoiding big) preempts -> both avoided: big again
    assert [len(big.generate_calls), len(small.generate_calls)] == [2, 1]


async def test_reschedules_are_bounded() -> None:
    cluster = MemoryCluster(preempt_retry_count=1)
    _, decode = _pd(cluster)
    decode.script = [preempt(after=1)] * 3
    with pytest.raises(PdserveError) as raised:
        await cluster.run(cluster.request())
    assert raised.value.reason is R.PREEMPTED
    assert len(decode.generate_calls) == 2 and decode.num_open_leases == 0


@pytest.mark.parametrize("fault", [lose(after=4), end(after=4)], ids=["lost", "ended_early"])
async def test_a_decode_lost_mid_stream_continues_on_the_other(
    cluster: MemoryCluster, fault: Fault
) -> None:
    cluster.add_prefill()
    doomed = cluster.add_decode("decode-doomed", num_blocks=2000)
    survivor = cluster.add_decode("decode-survivor")
    doomed.script = [fault]
    request = cluster.request()
    completion = await cluster.run(request)
    assert completion.token_ids == expected(request)
    assert completion.end.num_reschedules == 1
    assert len(survivor.generate_calls) == 1
    assert cluster.metrics.count("reschedules", "decode_lost") == 1
    entry = cluster.registry.get("decode-doomed")
    assert entry is not None and not entry.is_reachable
    assert doomed.num_open_leases == 0


# ---- retries by scope --------------------------------------------------------------------------


async def test_a_lost_prefill_is_retried_on_another(cluster: MemoryCluster) -> None:
    dead = cluster.add_prefill("prefill-dead")
    other = cluster.add_prefill("prefill-other", num_queued_prompt_tokens=500)
    cluster.add_decode()
    dead.script = [lose()]
    request = cluster.request()
    assert (await cluster.run(request)).token_ids == expected(request)
    assert len(other.calls) == 1
    assert cluster.metrics.count("retries", "PEER_UNAVAILABLE") == 1
    entry = cluster.registry.get("prefill-dead")
    assert entry is not None and not entry.is_reachable
    # NOTE: it did not say it ended the request, so it is told to (best effort).
    assert dead.aborted == [request.request_id]


async def test_a_decode_refusal_routes_to_the_other_decode(cluster: MemoryCluster) -> None:
    cluster.add_prefill()
    full = cluster.add_decode("decode-full", num_blocks=2000)
    spare = cluster.add_decode("decode-spare")
    full.refuse(retry_delay_s=2.0)
    request = cluster.request()
    assert (await cluster.run(request)).token_ids == expected(request)
    assert (full.generate_calls, len(spare.generate_calls)) == ([], 1)
    assert cluster.metrics.count("retries", "DECODE_CAPACITY_EXHAUSTED") == 1


async def test_all_decodes_full_waits_for_room_then_refuses_at_the_queue_bound() -> None:
    cluster = MemoryCluster(QueueLimits(max_queue_wait_s=0.3))
    prefill = cluster.add_prefill()
    decodes = [cluster.add_decode(f"decode-{index}") for index in range(2)]
    for decode in decodes:
        decode.refuse(retry_delay_s=2.0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(PdserveError) as raised:
        await cluster.run(cluster.request())
    # NOTE: both refused once; marked full, neither is asked again before it reports (a second
    # ask would have been granted: each has one refusal scripted, both taken).
    assert loop.time() - started >= 0.3
    assert [len(d.refusals) for d in decodes] == [0, 0]
    assert raised.value.reason is R.DECODE_CAPACITY_EXHAUSTED  # -> 429 with Retry-After
    assert raised.value.metadata["limit"] == "max_queue_wait_s"
    assert raised.value.retry_delay_s == 0.3  # nothing drained lately: the wait bound
    assert len(prefill.calls) == 2
    assert cluster.metrics.count("queue_refusals", "max_queue_wait_s") == 1
    assert cluster.orchestrator.queue.num_waiting == 0


async def test_a_refused_request_waits_for_the_next_load_report() -> None:
    cluster = MemoryCluster(max_attempts=1)
    prefill, decode = _pd(cluster)
    decode.refuse(times=2)  # more refusals than max_attempts allows failures
    request = cluster.request()
    running = asyncio.ensure_future(cluster.run(request))
    await eventually(lambda: cluster.orchestrator.queue.num_waiting == 1)
    assert len(prefill.calls) == 1
    cluster.report()  # the decode reports: tried again, refused again
    await eventually(lambda: len(prefill.calls) == 2 and cluster.orchestrator.queue.num_waiting)
    cluster.report()
    completion = await running
    assert completion.token_ids == expected(request)
    assert completion.end.num_attempts == 3
    assert cluster.metrics.count("retries", "DECODE_CAPACITY_EXHAUSTED") == 2


async def test_a_started_completion_waits_for_decode_capacity() -> None:
    cluster = MemoryCluster(max_attempts=1)
    _, decode = _pd(cluster)
    decode.script = [preempt(after=3)]
    decode.refuse(times=2, retry_delay_s=0.01, after=1)  # the continuation finds it full, twice

    async def report() -> None:
        while True:
            await asyncio.sleep(0.01)
            cluster.report()

    reporting = asyncio.ensure_future(report())
    request = cluster.request()
    try:
        completion = await cluster.run(request)
    finally:
        reporting.cancel()
    assert completion.token_ids == expected(request)
    assert (completion.end.num_attempts, completion.end.num_reschedules) == (4, 1)
    assert cluster.metrics.count("retries", "DECODE_CAPACITY_EXHAUSTED") == 2


async def test_more_requests_than_the_decode_holds_queue_and_all_complete() -> None:
    cluster = MemoryCluster()
    prefill = cluster.add_prefill()
    cluster.add_decode(num_blocks=2 * LEASE_BLOCKS + 1)  # two at once
    requests = [cluster.request(seed=seed) for seed in range(8)]
    completions = await asyncio.gather(*(cluster.run(request) for request in requests))
    assert [c.token_ids for c in completions] == [expected(r) for r in requests]
    assert cluster.metrics.count("retries", "DECODE_CAPACITY_EXHAUSTED") == 0
    # NOTE: in order of arrival; never more than two at once on the decode.
    assert [call.request_id for call in prefill.calls] == [r.request_id for r in requests]
    assert cluster.orchestrator.queue.num_waiting == 0
    assert cluster.router.loads.unreported_work("decode-0") == 0


async def test_a_request_cancelled_in_the_queue_leaves_nothing_behind() -> None:
    cluster = MemoryCluster()
    prefill = cluster.add_prefill()
    decode = cluster.add_decode(num_blocks=LEASE_BLOCKS)  # one request at a time
    decode.script = [stall()]
    first, second, third = (cluster.request(seed=seed) for seed in range(3))
    running = asyncio.ensure_future(cluster.run(first))
    await eventually(lambda: len(decode.generate_calls) == 1)
    queued = [asyncio.ensure_future(cluster.run(r)) for r in (second, third)]
    await eventually(lambda: cluster.orchestrator.queue.num_waiting == 2)
    queued[0].cancel()  # the client of the head goes away
    await eventually(lambda: cluster.orchestrator.queue.num_waiting == 1)
    assert cluster.orchestrator.queue.num_waiting_tokens == len(PROMPT_IDS)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert (await queued[1]).token_ids == expected(third)
    assert [call.request_id for call in prefill.calls] == [first.request_id, third.request_id]
    assert cluster.orchestrator.queue.num_waiting == 0
    assert cluster.router.loads.unreported_work("decode-0") == 0


async def test_a_request_the_decodes_can_never_hold_fails_at_once() -> None:
    cluster = MemoryCluster()
    prefill = cluster.add_prefill()
    cluster.add_decode(num_blocks=LEASE_BLOCKS - 1)
    with pytest.raises(PdserveError) as raised:
        await cluster.run(cluster.request())
    assert raised.value.reason is R.PROMPT_TOO_LONG
    assert prefill.calls == []


async def test_the_draining_decode_named_by_the_prefill_is_avoided(
    cluster: MemoryCluster,
) -> None:
    cluster.add_prefill()
    draining = cluster.add_decode("decode-draining", num_blocks=2000)
    other = cluster.add_decode("decode-other")
    draining.refuse(reason=R.INSTANCE_DRAINING)  # the registry has not heard yet
    request = cluster.request()
    assert (await cluster.run(request)).token_ids == expected(request)
    assert (draining.generate_calls, len(other.generate_calls)) == ([], 1)
    assert cluster.metrics.count("retries", "INSTANCE_DRAINING") == 1


@pytest.mark.parametrize("num_failures", [1, 2])
async def test_internal_errors_are_retried_once(num_failures: int) -> None:
    cluster = MemoryCluster(max_attempts=5)
    prefill, _ = _pd(cluster)
    prefill.script = [fail(R.INTERNAL)] * num_failures
    request = cluster.request()
    if num_failures == 1:
        assert (await cluster.run(request)).token_ids == expected(request)
    else:
        with pytest.raises(PdserveError) as raised:
            await cluster.run(request)
        assert raised.value.reason is R.INTERNAL
    # NOTE: a prefill that reported the failure itself has ended the request: no abort.
    assert prefill.aborted == []


async def test_a_corrupt_transfer_moves_to_another_pair_or_retries_the_same(
    cluster: MemoryCluster,
) -> None:
    first = cluster.add_prefill("prefill-a")
    decode = cluster.add_decode("decode-a", num_blocks=2000)
    first.script = [fail(R.CACHE_SYNC_FAILED)] * 2
    request = cluster.request()
    assert (await cluster.run(request)).token_ids == expected(request)  # the only pair, twice
    other = cluster.add_prefill("prefill-b", num_queued_prompt_tokens=500)
    spare = cluster.add_decode("decode-b")
    first.script = [fail(R.CACHE_SYNC_FAILED)]
    request = cluster.request()
    assert (await cluster.run(request)).token_ids == expected(request)
    assert (len(other.calls), len(spare.generate_calls), len(decode.generate_calls)) == (1, 1, 1)


# ---- dedupe by completion index ---------------------------------------------------------------


async def test_resent_tokens_reach_the_consumer_once(cluster: MemoryCluster) -> None:
    _, decode = _pd(cluster)
    decode.script = [preempt(after=5), repeat(4)]
    request = cluster.request()
    completion = await cluster.run(request)
    assert completion.token_ids == expected(request)  # checks the indices too


async def test_a_skipped_index_fails_the_attempt_and_the_retry_fills_it(
    cluster: MemoryCluster,
) -> None:
    _, decode = _pd(cluster)
    decode.script = [skip(after=4)]
    request = cluster.request()
    completion = await cluster.run(request)
    assert completion.token_ids == expected(request)
    assert completion.end.num_attempts == 2
    assert cluster.metrics.count("retries", "INTERNAL") == 1
    assert decode.num_open_leases == 0


# ---- cleanup when an attempt is left early -----------------------------------------------------


async def _leave_when_stalled(
    cluster: MemoryCluster, request: GenerationRequest, instance: MemoryInstance
) -> list[TokenChunk]:
    """Consumes `request`'s tokens until `instance` stalls, then goes away (as a client that
    disconnects does: its task is cancelled); returns what it received."""
    received: list[TokenChunk] = []

    async def consume() -> None:
        async for event in cluster.stream(request):
            assert isinstance(event, TokenChunk)
            received.append(event)

    consuming = asyncio.create_task(consume())
    await instance.stalled.wait()
    consuming.cancel()
    await asyncio.gather(consuming, return_exceptions=True)
    await cluster.orchestrator.wait_for_cleanups()
    return received


async def test_a_consumer_leaving_while_decoding_releases_the_lease(
    cluster: MemoryCluster,
) -> None:
    prefill, decode = _pd(cluster)
    decode.script = [stall(after=2)]
    received = await _leave_when_stalled(cluster, cluster.request(), decode)
    assert [(e.first_index, len(e.token_ids)) for e in received] == [(0, 1), (1, 2)]
    assert decode.released == decode.generate_calls and decode.num_open_leases == 0
    assert prefill.aborted == []  # it had handed off


async def test_a_consumer_leaving_before_the_hand_off_aborts_on_the_prefill(
    cluster: MemoryCluster,
) -> None:
    prefill, decode = _pd(cluster)
    prefill.script = [stall(after=1)]
    request = cluster.request()
    received = await _leave_when_stalled(cluster, request, prefill)
    assert len(received) == 1  # the first token comes before the hand-off
    assert prefill.aborted == [request.request_id]
    assert decode.num_open_leases == 0 and decode.generate_calls == []


async def test_an_end_the_gateway_sees_first_releases_the_lease(cluster: MemoryCluster) -> None:
    """The gateway's stop rule ends the completion while the instance goes on."""
    _, decode = _pd(cluster)
    stop_id = expected(cluster.request())[0]
    request = cluster.request(eos_token_ids=(stop_id,))
    completion = await cluster.run(request)
    assert completion.token_ids == [stop_id] and completion.end.finish_reason is FinishReason.STOP
    assert decode.generate_calls == [] and len(decode.released) == 1
    assert decode.num_open_leases == 0


async def test_a_decode_that_goes_on_past_the_end_is_released_after_the_grace() -> None:
    cluster = MemoryCluster(end_grace_s=0.05)
    _, decode = _pd(cluster)
    stop_id = expected(cluster.request())[3]
    decode.script = [stall(after=4)]
    request = cluster.request(eos_token_ids=(stop_id,))
    completion = await cluster.run(request)
    assert completion.token_ids == expected(request)[:4]
    assert decode.released == decode.generate_calls and decode.num_open_leases == 0


async def test_the_request_timeout_bounds_a_stalled_decode(cluster: MemoryCluster) -> None:
    _, decode = _pd(cluster)
    decode.script = [stall(after=1)]
    with pytest.raises(PdserveError) as raised:
        await cluster.run(cluster.request(), timeout_s=0.2)
    assert raised.value.reason is R.DEADLINE_EXCEEDED
    assert decode.num_open_leases == 0


# ---- instances the registry loses (frozen: silent, connections open) -------------------------


async def _lose_when_stalled(
    cluster: MemoryCluster, stalled: MemoryInstance, lost: MemoryInstance | None = None
) -> None:
    """Once `stalled` stalls, `lost` (default: the same instance) stops heartbeating."""
    await stalled.stalled.wait()
    cluster.lose(lost or stalled)


async def test_a_stream_on_a_frozen_decode_moves_to_the_other(cluster: MemoryCluster) -> None:
    cluster.add_prefill()
    doomed = cluster.add_decode("decode-doomed", num_blocks=2000)
    survivor = cluster.add_decode("decode-survivor")
    doomed.script = [stall(after=4)]
    request = cluster.request()
    losing = asyncio.create_task(_lose_when_stalled(cluster, doomed))
    completion = await cluster.run(request)
    await losing
    assert completion.token_ids == expected(request)
    assert cluster.metrics.count("reschedules", "decode_lost") == 1
    assert len(survivor.generate_calls) == 1
    assert doomed.num_open_leases == 0  # the interrupted stream was closed
    assert cluster.orchestrator.loss_watch.num_watchers == 0


async def test_a_decode_frozen_before_the_hand_off_moves_the_request(
    cluster: MemoryCluster,
) -> None:
    prefill = cluster.add_prefill()
    doomed = cluster.add_decode("decode-doomed", num_blocks=2000)
    survivor = cluster.add_decode("decode-survivor")
    prefill.script = [stall(after=1)]  # the prefill waits on the decode
    request = cluster.request()
    losing = asyncio.create_task(_lose_when_stalled(cluster, prefill, doomed))
    completion = await cluster.run(request)
    await losing
    assert completion.token_ids == expected(request)
    assert doomed.generate_calls == [] and len(survivor.generate_calls) == 1
    assert cluster.metrics.count("reschedules", "decode_lost") == 1
    assert prefill.aborted == [request.request_id]
    assert doomed.num_open_leases == 0


async def test_a_retry_on_the_same_prefill_waits_for_the_abort_of_the_attempt_before(
    cluster: MemoryCluster,
) -> None:
    """The retry reuses the request id: an AbortRequest arriving after it started would
    cancel it (the client saw a 499), so it starts once the abort has arrived."""
    prefill = cluster.add_prefill()
    doomed = cluster.add_decode("decode-doomed", num_blocks=2000)
    cluster.add_decode("decode-survivor")
    prefill.script = [stall(after=1)]
    prefill.abort_delay_s = 0.2
    request = cluster.request()
    losing = asyncio.create_task(_lose_when_stalled(cluster, prefill, doomed))
    completion = await cluster.run(request)
    await losing
    assert completion.token_ids == expected(request)
    request_id = request.request_id
    assert prefill.history == [f"prefill {request_id}", f"abort {request_id}",
                               f"prefill {request_id}"]  # fmt: skip


async def test_a_prefill_frozen_before_the_hand_off_is_retried_on_another(
    cluster: MemoryCluster,
) -> None:
    doomed = cluster.add_prefill("prefill-doomed")
    other = cluster.add_prefill("prefill-other", num_queued_prompt_tokens=500)
    decode = cluster.add_decode()
    doomed.script = [stall(after=1)]  # first token sent, then silence
    request = cluster.request()
    losing = asyncio.create_task(_lose_when_stalled(cluster, doomed))
    completion = await cluster.run(request)
    await losing
    assert completion.token_ids == expected(request)
    assert _continued_from(other) == [1]
    assert cluster.metrics.count("retries", "PEER_UNAVAILABLE") == 1
    assert decode.num_open_leases == 0


async def test_a_draining_decode_that_deregisters_keeps_its_streams(
    cluster: MemoryCluster,
) -> None:
    """Deregistering is a graceful goodbye, not a loss: running streams finish where they are."""
    _, decode = _pd(cluster)
    resume = asyncio.Event()
    decode.script = [stall(after=3, until=resume)]
    request = cluster.request()
    running = asyncio.create_task(cluster.run(request))
    await decode.stalled.wait()
    cluster.registry.deregister(decode.instance_id)
    resume.set()
    assert (await running).token_ids == expected(request)
    assert cluster.metrics.count("reschedules", "decode_lost") == 0
    await eventually(lambda: cluster.orchestrator.loss_watch.num_watchers == 0)


async def test_every_attempt_gives_its_booked_work_back_to_the_router(
    cluster: MemoryCluster,
) -> None:
    prefill, decode = _pd(cluster)
    decode.script = [preempt(after=3)]
    request = cluster.request(seed=5)
    before = cluster.router.loads.unreported_work(prefill.instance_id)
    assert (await cluster.run(request)).token_ids == expected(request)
    # Two attempts booked prompt tokens on the prefill and blocks on the decode; no report
    # arrived since, and both ended: the router counts nothing of them any more.
    assert len(prefill.calls) == 2
    assert before == 0
    assert cluster.router.loads.unreported_work(prefill.instance_id) == 0
    assert cluster.router.loads.unreported_work(decode.instance_id) == 0


async def test_a_prefill_going_down_is_waited_for_instead_of_retried_until_attempts_run_out() -> (
    None
):
    cluster = MemoryCluster()
    prefill = cluster.add_prefill()
    cluster.add_decode()
    # NOTE: the only prefill lost a rank: every call fails as it goes down (its registry entry
    # still listed until it deregisters), then it is started again under the same id.
    prefill.script += [fail(R.INSTANCE_DRAINING, instanceId=prefill.instance_id)] * 5
    request = cluster.request()
    running = asyncio.ensure_future(cluster.run(request))
    await eventually(lambda: cluster.metrics.peer_waiting._value.get() == 1, what="a peer wait")
    assert len(prefill.calls) == 1  # not retried on the instance that said it is going away
    prefill.script.clear()
    cluster.registry.heartbeat(prefill.instance_id, LoadReport())  # back, admitting
    assert (await running).token_ids == expected(request)
    assert len(prefill.calls) == 2
