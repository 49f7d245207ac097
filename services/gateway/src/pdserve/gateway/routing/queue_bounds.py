"""The admission queue's bounds and what its refusals say: the limits (`QueueLimits`), the
reasons that mean "wait for room" (`is_wait`), and the drain rate its retry hint comes from
(`DrainRate`)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.common.config import setting
from pdserve.common.errors import ErrorReason, PdserveError

WAIT_REASONS = frozenset({ErrorReason.DECODE_CAPACITY_EXHAUSTED, ErrorReason.PREFILL_OVERLOADED})
"""Reasons a routing (or an instance's refusal) means: no room now, wait for it."""

MAX_QUEUED_REQUESTS = "max_queued_requests"
MAX_QUEUED_TOKENS = "max_queued_tokens"
MAX_QUEUE_WAIT_S = "max_queue_wait_s"
BOUNDS = (MAX_QUEUED_REQUESTS, MAX_QUEUED_TOKENS, MAX_QUEUE_WAIT_S)

# NOTE: the drain rate is measured over the last admissions out of the queue within this window.
RATE_WINDOW_S = 60.0
RATE_SAMPLES = 64


@dataclass(frozen=True)
class QueueLimits:
    """Bounds of the admission queue; each is a gateway flag of the same name (see
    docs/limits.md), whose help text and range are the field's."""

    max_queued_requests: int = setting(
        256,
        "requests that may wait at once in the admission queue for a decode (and "
        "prefill) with room; one more gets 429 with Retry-After at once",
        min=1,
    )
    max_queued_tokens: int = setting(
        262_144,
        "prompt tokens that may wait at once in the admission queue; a request that "
        "would pass it gets 429 with Retry-After at once",
        min=1,
    )
    max_queue_wait_s: float = setting(
        60.0,
        "seconds a new request may wait in the admission queue for room; then 429 "
        "with Retry-After (a request already streaming waits up to --request-timeout)",
        gt=0,
    )


class NoPairAlive(PdserveError):
    """NO_HEALTHY_INSTANCES because no prefill/decode pair of the model is alive at all (not
    because of a request's own exclusions or needs): a request already waiting in the admission
    queue goes on waiting for one to come back (within its bounds) instead of failing."""


def is_wait(error: PdserveError) -> bool:
    """Whether `error` says: no room now (wait), rather than: this request failed."""
    return error.reason in WAIT_REASONS and error.metadata.get("limit") not in BOUNDS


class DrainRate:
    """How fast the queue admitted requests lately (the last `RATE_SAMPLES` admissions within
    `RATE_WINDOW_S`).

    Args:
        clock: Monotonic seconds.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._admitted_at: deque[float] = deque(maxlen=RATE_SAMPLES)

    def record(self) -> None:
        """A request left the queue for an attempt."""
        self._admitted_at.append(self._clock())

    def retry_after_s(self, num_waiting: int, bound_s: float) -> float:
        """Seconds until `num_waiting` requests (and one more) have likely been admitted at
        the recent rate, within [1, `bound_s`]; `bound_s` when there was no recent rate."""
        now = self._clock()
        recent = [t for t in self._admitted_at if now - t <= RATE_WINDOW_S]
        if len(recent) < 2 or recent[-1] <= recent[0]:
            return bound_s
        rate = (len(recent) - 1) / (recent[-1] - recent[0])
        return max(1.0, min(bound_s, (num_waiting + 1) / rate))
