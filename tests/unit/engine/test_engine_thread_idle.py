"""An engine loop hands the allocator's free pages back once it has been idle after work."""

from __future__ import annotations

import threading
from collections import deque

import pytest

from pdserve.engine import thread as engine_thread
from pdserve.engine.thread import EngineThread


class _Loop(EngineThread):
    """Takes items from a queue; `done` is set after each."""

    def __init__(self, idle_trim_s: float | None) -> None:
        self.items: deque[int] = deque()
        self.done = threading.Event()
        super().__init__("test-loop", idle_trim_s=idle_trim_s)

    def put(self, item: int) -> None:
        with self._cond:
            self.items.append(item)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._is_stopped or self.items):
                    self._wait_for_work()
                if self._is_stopped:
                    return
                self.items.popleft()
            self.done.set()


@pytest.fixture
def trims(monkeypatch: pytest.MonkeyPatch) -> list[threading.Event]:
    """Each call of `return_freed_memory` sets the next event of the list."""
    events = [threading.Event() for _ in range(5)]
    calls = iter(events)
    monkeypatch.setattr(engine_thread, "return_freed_memory", lambda: next(calls).set())
    return events


def test_an_idle_loop_trims_once_after_work_and_again_after_more(
    trims: list[threading.Event],
) -> None:
    loop = _Loop(idle_trim_s=0.01)
    loop.start()
    try:
        assert trims[0].wait(30), "no trim of a loop idle since its start"
        loop.put(1)
        assert loop.done.wait(30)
        assert trims[1].wait(30), "no trim after the loop went idle again"
        # Idle since that trim: no work, so the loop waits without a timeout (no third trim).
        assert not trims[2].wait(0.2)
        assert loop.num_idle_trims == 2
        loop.done.clear()
        loop.put(2)
        assert loop.done.wait(30)
        assert trims[2].wait(30), "no trim after the second burst"
    finally:
        assert loop.stop()
    assert not trims[3].is_set()


def test_a_loop_idle_from_its_start_trims_once_and_one_that_may_not_never(
    trims: list[threading.Event],
) -> None:
    idle = _Loop(idle_trim_s=0.01)
    no_trim = _Loop(idle_trim_s=None)
    for loop in (idle, no_trim):
        loop.start()
    try:
        assert trims[0].wait(30), "no trim of a loop idle since its start"
        no_trim.put(1)
        assert no_trim.done.wait(30)
        assert not trims[1].wait(0.2)
    finally:
        assert idle.stop() and no_trim.stop()
    assert (idle.num_idle_trims, no_trim.num_idle_trims) == (1, 0)


def test_the_trim_runs_outside_the_loops_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = _Loop(idle_trim_s=0.01)
    taken: list[bool] = []
    trimmed = threading.Event()

    def try_the_lock() -> None:
        is_free = loop._cond.acquire(blocking=False)
        if is_free:
            loop._cond.release()
        taken.append(is_free)

    def trim() -> None:
        probe = threading.Thread(target=try_the_lock)
        probe.start()
        probe.join()
        trimmed.set()

    monkeypatch.setattr(engine_thread, "return_freed_memory", trim)
    loop.start()
    try:
        assert trimmed.wait(30)
        loop.put(1)  # the loop still takes work after a trim
        assert loop.done.wait(30)
    finally:
        assert loop.stop()
    assert taken[0], "another thread could not take the loop's lock during the trim"
