"""The admission queue alone: order of arrival, its bounds exactly, leaving it, the retry hint
from its drain rate. (Over the orchestrator: test_gateway_orchestrator.)"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from support.eventually import eventually

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.gateway.fleet.instance import InstanceRole
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.routing.pair import Pair
from pdserve.gateway.routing.queue import CapacityQueue
from pdserve.gateway.routing.queue_bounds import NoPairAlive, QueueLimits

NO_ROOM = PdserveError(ErrorReason.DECODE_CAPACITY_EXHAUSTED, "no room")


class Room:
    """A fake router: `free` slots; routing takes one or raises NO_ROOM."""

    def __init__(self, free: int = 0) -> None:
        self.free = free
        self.routed: list[str] = []
        self.settled: list[tuple[str, InstanceRole]] = []

    def route(self, name: str) -> Callable[[], Pair]:
        def route() -> Pair:
            if self.free <= 0:
                raise NO_ROOM
            self.free -= 1
            self.routed.append(name)
            return name  # type: ignore[return-value]

        return route

    def settle(self, pair: Pair, role: InstanceRole) -> None:
        self.settled.append((pair, role))  # type: ignore[arg-type]


def _queue(room: Room, clock: Callable[[], float] | None = None, **limits: float) -> CapacityQueue:
    metrics = GatewayMetrics()
    if clock is None:
        return CapacityQueue(QueueLimits(**limits), metrics, room.settle)  # type: ignore[arg-type]
    return CapacityQueue(QueueLimits(**limits), metrics, room.settle, clock)  # type: ignore[arg-type]


def _admit(
    queue: CapacityQueue, room: Room, name: str, num_tokens: int = 10, **kwargs: object
) -> asyncio.Future[tuple[Pair, float]]:
    settings: dict[str, object] = {"timeout_s": 10.0, "bounded": True, **kwargs}
    return asyncio.ensure_future(
        queue.admit(
            model="m",
            seq=queue.arrival(),
            num_tokens=num_tokens,
            route=room.route(name),
            **settings,  # type: ignore[arg-type]
        )
    )


async def test_routes_at_once_when_there_is_room_and_nobody_waits() -> None:
    room = Room(free=1)
    queue = _queue(room)
    pair, waited_s = await _admit(queue, room, "a")
    assert (pair, waited_s, queue.num_waiting) == ("a", 0.0, 0)


async def test_waiters_are_routed_in_order_of_arrival_as_room_appears() -> None:
    room = Room()
    queue = _queue(room)
    waiting = [_admit(queue, room, name) for name in "abc"]
    await eventually(lambda: queue.num_waiting == 3)
    assert queue.num_waiting_tokens == 30
    room.free = 2
    queue.kick()
    await eventually(lambda: queue.num_waiting == 1)
    assert room.routed == ["a", "b"]
    # NOTE: a newcomer does not overtake the one still waiting, even when room appears.
    late = _admit(queue, room, "d")
    await eventually(lambda: queue.num_waiting == 2)
    room.free = 2
    queue.kick()
    results = await asyncio.gather(*waiting, late)
    assert [pair for pair, _ in results] == ["a", "b", "c", "d"]
    assert all(waited_s > 0 for _, waited_s in results)


async def test_a_request_that_arrived_earlier_goes_ahead_when_it_comes_back() -> None:
    room = Room()
    queue = _queue(room)
    early = queue.arrival()
    later = _admit(queue, room, "later")
    await eventually(lambda: queue.num_waiting == 1)
    back = asyncio.ensure_future(
        queue.admit(
            model="m",
            seq=early,
            num_tokens=1,
            route=room.route("early"),
            timeout_s=5,
            bounded=False,
        )
    )
    await eventually(lambda: queue.num_waiting == 2)
    room.free = 1
    queue.kick()
    assert (await back)[0] == "early"
    assert not later.done()
    later.cancel()


async def test_the_request_bound_refuses_exactly_past_it() -> None:
    room = Room()
    queue = _queue(room, max_queued_requests=2)
    waiting = [_admit(queue, room, name) for name in "ab"]
    await eventually(lambda: queue.num_waiting == 2)
    with pytest.raises(PdserveError) as refused:
        await _admit(queue, room, "c")
    assert refused.value.reason is ErrorReason.DECODE_CAPACITY_EXHAUSTED
    assert refused.value.metadata["limit"] == "max_queued_requests"
    assert refused.value.retry_delay_s is not None and refused.value.retry_delay_s > 0
    # NOTE: a request already streaming is not bound by the queue's size.
    streaming = _admit(queue, room, "streaming", bounded=False)
    await eventually(lambda: queue.num_waiting == 3)
    for future in [*waiting, streaming]:
        future.cancel()


async def test_the_token_bound_refuses_exactly_past_it() -> None:
    room = Room()
    queue = _queue(room, max_queued_tokens=100)
    first = _admit(queue, room, "a", num_tokens=60)
    second = _admit(queue, room, "b", num_tokens=40)  # 100: exactly at the bound
    await eventually(lambda: queue.num_waiting == 2)
    with pytest.raises(PdserveError) as refused:
        await _admit(queue, room, "c", num_tokens=1)
    assert refused.value.metadata["limit"] == "max_queued_tokens"
    first.cancel()
    second.cancel()


async def test_the_wait_bound_refuses_when_it_passes() -> None:
    room = Room()
    queue = _queue(room, max_queue_wait_s=0.2)
    with pytest.raises(PdserveError) as refused:
        await _admit(queue, room, "a")
    assert refused.value.metadata["limit"] == "max_queue_wait_s"
    assert queue.num_waiting == 0
    # NOTE: earlier waits of the same request count: nothing is left of its bound.
    with pytest.raises(PdserveError) as again:
        await _admit(queue, room, "a", waited_s=0.2)
    assert again.value.metadata["limit"] == "max_queue_wait_s"


async def test_the_deadline_ends_a_wait_the_queue_does_not_bound() -> None:
    room = Room()
    queue = _queue(room)
    with pytest.raises(PdserveError) as timed_out:
        await _admit(queue, room, "a", timeout_s=0.1, bounded=False)
    assert timed_out.value.reason is ErrorReason.DEADLINE_EXCEEDED


async def test_a_cancelled_waiter_leaves_at_once_and_the_next_one_is_tried() -> None:
    room = Room()
    queue = _queue(room)
    big, small = _admit(queue, room, "big", num_tokens=50), _admit(queue, room, "small")
    await eventually(lambda: queue.num_waiting == 2)
    room.free = 1  # room appears, unseen until something kicks the queue
    big.cancel()
    assert (await small)[0] == "small"  # its leaving kicked the queue
    assert (queue.num_waiting, queue.num_waiting_tokens) == (0, 0)


async def test_a_waiter_routed_but_gone_before_it_ran_gives_its_pair_back() -> None:
    room = Room()
    queue = _queue(room)
    waiter = _admit(queue, room, "a")
    await eventually(lambda: queue.num_waiting == 1)
    room.free = 1
    queue.kick()
    await asyncio.sleep(0)  # NOTE: the drain runs and routes it...
    waiter.cancel()  # ...and its client goes away before the task resumes
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert room.routed == ["a"]
    assert room.settled == [("a", InstanceRole.PREFILL), ("a", InstanceRole.DECODE)]


async def test_an_error_other_than_no_room_ends_only_that_request() -> None:
    room = Room()
    queue = _queue(room)

    def broken() -> Pair:
        if room.free <= 0:
            raise NO_ROOM
        raise PdserveError(ErrorReason.NO_HEALTHY_INSTANCES, "gone")

    failing = asyncio.ensure_future(
        queue.admit(model="m", seq=queue.arrival(), num_tokens=1, route=broken, timeout_s=5,
                    bounded=True)
    )  # fmt: skip
    behind = _admit(queue, room, "b")
    await eventually(lambda: queue.num_waiting == 2)
    room.free = 1
    queue.kick()
    with pytest.raises(PdserveError) as raised:
        await failing
    assert raised.value.reason is ErrorReason.NO_HEALTHY_INSTANCES
    assert (await behind)[0] == "b"


async def test_a_waiting_request_whose_pairs_all_vanished_waits_for_one_to_come_back() -> None:
    room = Room()
    queue = _queue(room)
    is_alive = [True]

    def restarting() -> Pair:
        if not is_alive[0]:
            raise NoPairAlive(ErrorReason.NO_HEALTHY_INSTANCES, "no pair serves model m")
        return room.route("a")()

    waiting = asyncio.ensure_future(
        queue.admit(model="m", seq=queue.arrival(), num_tokens=1, route=restarting, timeout_s=5,
                    bounded=True)
    )  # fmt: skip
    await eventually(lambda: queue.num_waiting == 1)
    is_alive[0] = False  # every instance restarts: the queue is tried and finds no pair
    queue.kick()
    await asyncio.sleep(0.05)
    assert not waiting.done()
    is_alive[0], room.free = True, 1  # one registers again, with room
    queue.kick()
    assert (await waiting)[0] == "a"


async def test_the_retry_hint_follows_the_drain_rate() -> None:
    now = [0.0]
    room = Room()
    queue = _queue(room, lambda: now[0], max_queue_wait_s=60)
    assert queue.retry_after_s() == 60  # nothing drained yet: the wait bound
    waiting = [_admit(queue, room, str(index)) for index in range(5)]
    await eventually(lambda: queue.num_waiting == 5)
    for _ in range(3):  # three admissions, one every 2 s: 0.5 a second
        room.free = 1
        queue.kick()
        await eventually(lambda: room.free == 0)
        now[0] += 2.0
    assert queue.num_waiting == 2
    assert queue.retry_after_s() == pytest.approx(3 / 0.5)  # (2 waiting + 1) at 0.5/s
    for future in waiting:
        future.cancel()
