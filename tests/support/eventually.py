"""Waiting for a condition, never for a fixed time."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable


async def eventually(
    condition: Callable[[], bool | Awaitable[bool]],
    timeout_s: float = 30.0,
    what: str = "the condition",
) -> None:
    """Polls `condition()` every 10 ms until it is true; fails the test after `timeout_s`.

    Args:
        condition: A function, or a coroutine function (e.g. one that asks a server).
        timeout_s: How long the condition may take.
        what: Names the condition in the failure message.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout_s} s")
        await asyncio.sleep(0.01)
