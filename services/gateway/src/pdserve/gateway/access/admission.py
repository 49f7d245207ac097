"""Admission: how many generation requests may be in flight (per API key and in total), and
how often each key may start one.

A request holds an `Admission` from before its body is parsed until its response has ended
(the last SSE event sent, or the gRPC stream closed); one past a limit is refused at once with
RATE_LIMITED (HTTP 429 with ``Retry-After``, gRPC RESOURCE_EXHAUSTED with RetryInfo). The
per-key limits count by `Caller.limit_key` (the key's name), and a key's own ``concurrency=`` and
``rpm=`` replace the gateway's per-key settings for that key.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import TracebackType
from typing import NamedTuple

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.gateway.access.auth import Caller


class Admission:
    """One admitted request's place; `release` (or leaving the ``with`` block) gives it back."""

    def __init__(self, limiter: ConcurrencyLimiter, key: str) -> None:
        self._limiter = limiter
        self._key = key
        self._is_released = False

    def release(self) -> None:
        """Gives the place back. Idempotent."""
        if not self._is_released:
            self._is_released = True
            self._limiter._release(self._key)

    def __enter__(self) -> Admission:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()


class ConcurrencyLimiter:
    """Counts requests in flight per API key and in total; with a `RateLimiter`, also meters
    how often each key starts one.

    Args:
        max_total: Requests in flight on the gateway.
        max_per_key: Requests in flight per API key (a key's ``concurrency=`` replaces it).
        retry_after_s: Retry delay suggested to a request refused for concurrency.
        rate: Token buckets per key; a request refused for concurrency spends no token.
    """

    def __init__(
        self,
        max_total: int,
        max_per_key: int,
        retry_after_s: float = 1.0,
        *,
        rate: RateLimiter | None = None,
    ) -> None:
        self._max_total = max_total
        self._max_per_key = max_per_key
        self._retry_after_s = retry_after_s
        self._rate = rate
        self._num_total = 0
        self._num_per_key: dict[str, int] = {}

    @property
    def num_in_flight(self) -> int:
        """Requests admitted and not yet released."""
        return self._num_total

    def admit(self, caller: Caller) -> Admission:
        """Admits a request of `caller`.

        Raises:
            PdserveError: RATE_LIMITED when the key or the gateway is at its limit, or the key
                has no request left this minute.
        """
        key = caller.limit_key
        max_per_key = self._max_per_key
        if caller.api_key is not None and caller.api_key.max_concurrent_requests is not None:
            max_per_key = caller.api_key.max_concurrent_requests
        num_for_key = self._num_per_key.get(key, 0)
        if num_for_key >= max_per_key:
            raise self._refusal(f"too many requests in flight for this API key ({num_for_key})")
        if self._num_total >= self._max_total:
            raise self._refusal(f"too many requests in flight on the gateway ({self._num_total})")
        if self._rate is not None:
            self._rate.acquire(caller)
        self._num_per_key[key] = num_for_key + 1
        self._num_total += 1
        return Admission(self, key)

    def _refusal(self, message: str) -> PdserveError:
        return PdserveError(
            ErrorReason.RATE_LIMITED, message + "; retry later", retry_delay_s=self._retry_after_s
        )

    def _release(self, key: str) -> None:
        self._num_total -= 1
        remaining = self._num_per_key[key] - 1
        if remaining:
            self._num_per_key[key] = remaining
        else:
            del self._num_per_key[key]


class _Bucket(NamedTuple):
    num_tokens: float
    updated_at: float
    full_at: float


class RateLimiter:
    """A token bucket per API key: ``requests_per_minute`` requests a minute, in bursts of up
    to a minute's worth (at least one).

    Args:
        requests_per_minute: Rate of a key without its own ``rpm=``; None: no limit.
        clock: Monotonic seconds.
    """

    MAX_BUCKETS = 10_000

    def __init__(
        self, requests_per_minute: float | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._requests_per_minute = requests_per_minute
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}

    def acquire(self, caller: Caller) -> None:
        """Spends one of `caller`'s tokens.

        Raises:
            PdserveError: RATE_LIMITED with the seconds until a token is there.
        """
        rpm = self._requests_per_minute
        if caller.api_key is not None and caller.api_key.requests_per_minute is not None:
            rpm = caller.api_key.requests_per_minute
        if rpm is None:
            return
        now = self._clock()
        capacity = max(1.0, rpm)
        tokens_per_s = rpm / 60.0
        bucket = self._buckets.get(caller.limit_key)
        num_tokens = capacity
        if bucket is not None:
            num_tokens = min(capacity, bucket.num_tokens + (now - bucket.updated_at) * tokens_per_s)
        if num_tokens < 1.0:
            raise PdserveError(
                ErrorReason.RATE_LIMITED,
                f"more than {rpm:g} requests a minute for this API key; retry later",
                retry_delay_s=(1.0 - num_tokens) / tokens_per_s,
            )
        num_tokens -= 1.0
        full_at = now + (capacity - num_tokens) / tokens_per_s
        self._buckets[caller.limit_key] = _Bucket(num_tokens, now, full_at)
        if len(self._buckets) > self.MAX_BUCKETS:
            # NOTE: a full bucket is the same as none; open gateways see many distinct tokens.
            self._buckets = {k: b for k, b in self._buckets.items() if b.full_at > now}
