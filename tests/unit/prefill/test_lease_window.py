"""The lease window: who may take a decode lease now, in arrival order, within a token bound."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.prefill.leasing import LeaseWindow, WindowPlace


async def _settle() -> None:
    """Lets every task that can run, run (no task here waits on anything but the window)."""
    for _ in range(5):
        await asyncio.sleep(0)


def _queue(window: LeaseWindow, num_tokens: int, decode: str = "d0") -> asyncio.Task[WindowPlace]:
    return asyncio.create_task(window.enter(num_tokens, decode))


async def test_requests_enter_in_order_while_the_leased_tokens_fit() -> None:
    window = LeaseWindow(100)
    first = await window.enter(60, "d0")
    first.leased()
    second, third = _queue(window, 50), _queue(window, 10)
    await _settle()
    # 60 + 50 > 100: the second waits, and the third, which would fit, waits behind it.
    assert not second.done() and not third.done()
    assert window.num_waiting == 2 and window.num_tokens == 60
    first.leave()
    await _settle()
    assert second.done() and third.done()
    assert not first.has_waited and second.result().has_waited
    assert window.num_waited == 2 and window.num_waiting == 0


async def test_the_first_in_line_always_enters_an_empty_window() -> None:
    window = LeaseWindow(10)
    huge = await window.enter(5_000, "d0")
    assert huge.is_asking
    huge.leased()
    behind = _queue(window, 1)
    await _settle()
    assert not behind.done()  # 5,000 + 1 > 10
    huge.leave()
    await _settle()
    assert behind.done()


async def test_a_request_asking_a_slow_decode_holds_back_only_that_decode() -> None:
    window = LeaseWindow(100)
    slow = await window.enter(80, "slow")  # asking; its lease does not come
    same_decode = _queue(window, 30, "slow")
    other_decode = _queue(window, 30, "fast")
    await _settle()
    assert not same_decode.done()
    assert other_decode.done()  # the slow decode's asker does not count against it
    other_decode.result().leased()
    slow.leave()  # its allocation failed
    await _settle()
    assert same_decode.done()  # 30 leased + 30 fits


async def test_a_long_prompt_is_not_starved_by_later_short_ones_for_other_decodes() -> None:
    window = LeaseWindow(100)
    running = await window.enter(60, "a")
    running.leased()
    long_prompt = _queue(window, 90, "b")  # no room beside the 60 leased
    short = _queue(window, 10, "c")  # would fit, but arrived later
    await _settle()
    assert not long_prompt.done() and not short.done()
    running.leave()
    await _settle()
    assert long_prompt.done()
    long_prompt.result().leased()
    await _settle()
    assert short.done()  # 90 + 10 fits


async def test_a_request_cancelled_in_line_takes_no_place() -> None:
    window = LeaseWindow(100)
    first = await window.enter(90, "d0")
    first.leased()
    cancelled, after = _queue(window, 50), _queue(window, 50)
    await _settle()
    cancelled.cancel()
    await _settle()
    assert window.num_waiting == 1
    first.leave()
    await _settle()
    assert after.done() and window.num_tokens == 0
    assert window._asking["d0"] == 50


async def test_a_request_let_in_as_it_is_cancelled_gives_its_place_back() -> None:
    window = LeaseWindow(100)
    first = await window.enter(90, "d0")
    first.leased()
    late = _queue(window, 50)
    await _settle()
    first.leave()  # lets `late` in (its future resolved) ...
    late.cancel()  # ... before its task ran again
    with pytest.raises(asyncio.CancelledError):
        await late
    assert window.num_tokens == 0 and window._asking["d0"] == 0
    assert (await window.enter(100, "d0")).is_asking


async def test_leaving_is_idempotent_and_counts_what_was_counted() -> None:
    window = LeaseWindow(100)
    asking = await window.enter(40, "d0")
    leased = await window.enter(30, "d1")
    leased.leased()
    leased.leased()
    assert window.num_tokens == 30 and window._asking["d0"] == 40
    asking.leave()
    asking.leave()
    leased.leave()
    leased.leave()
    assert window.num_tokens == 0 and window._asking["d0"] == 0 == window._asking["d1"]


async def test_without_a_bound_everyone_enters_at_once() -> None:
    window = LeaseWindow(None)
    places = [await window.enter(10_000, "d0") for _ in range(5)]
    for place in places:
        place.leased()
    assert window.num_tokens == 50_000 and window.num_waited == 0
