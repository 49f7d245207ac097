"""Silence measured on a clock that stands still while the gateway's own event loop is stalled:
heartbeats that arrived during a stall wait unread in the gateway, so the stall must not count
against the instances that sent them (`pdserve.gateway.fleet.registry`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

log = structlog.get_logger("pdserve.gateway.fleet.liveness")

Clock = Callable[[], float]


class LivenessClock:
    """Monotonic seconds that stand still while the event loop is stalled.

    `run` ticks every `tick_s` on the loop. Between ticks the clock follows the monotonic
    clock, but never more than two ticks past the last one: when the loop stalls, the clock
    stops there, and the next tick resumes it from where it stopped. Stalls shorter than two
    ticks count as time.

    Args:
        tick_s: Seconds between ticks.
        clock: The underlying monotonic clock (injectable for tests).
    """

    def __init__(self, tick_s: float = 0.1, clock: Clock = time.monotonic) -> None:
        self._tick_s = tick_s
        self._clock = clock
        self._last_tick = clock()
        self._stalled_s = 0.0

    def __call__(self) -> float:
        now = min(self._clock(), self._last_tick + 2 * self._tick_s)
        return now - self._stalled_s

    @property
    def stalled_s(self) -> float:
        """Seconds of loop stalls left out so far."""
        return self._stalled_s

    def tick(self) -> float:
        """Records that the loop is running now; returns the stall it ended (0 if none)."""
        now = self._clock()
        late_s = max(0.0, now - self._last_tick - 2 * self._tick_s)
        self._stalled_s += late_s
        self._last_tick = now
        return late_s

    async def run(self) -> None:
        """Ticks until cancelled (the time before the first tick is not a stall)."""
        self.tick()
        while True:
            await asyncio.sleep(self._tick_s)
            stall_s = self.tick()
            if stall_s:
                log.warning("event_loop_stalled", stall_s=round(stall_s + 2 * self._tick_s, 3))
