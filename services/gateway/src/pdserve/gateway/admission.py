"""Admission: how many generation requests may be in flight, per API key and in total.

A request holds an `Admission` from before its body is parsed until its response has ended
(the last SSE event sent, or the gRPC stream closed); one past either limit is refused at
once with RATE_LIMITED (HTTP 429, gRPC RESOURCE_EXHAUSTED with RetryInfo).
"""

from __future__ import annotations

import hashlib
from types import TracebackType

from pdserve.common.errors import ErrorReason, PdserveError

ANONYMOUS = b""


def _key(api_key: str | None) -> bytes:
    # NOTE: a digest, so the limiter never holds the keys themselves.
    if api_key is None:
        return ANONYMOUS
    return hashlib.blake2b(api_key.encode(), digest_size=16).digest()


class Admission:
    """One admitted request's place; `release` (or leaving the ``with`` block) gives it back."""

    def __init__(self, limiter: ConcurrencyLimiter, key: bytes) -> None:
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
    """Counts requests in flight per API key and in total.

    Args:
        max_total: Requests in flight on the gateway.
        max_per_key: Requests in flight per API key presented (requests without one share a
            count).
        retry_after_s: Retry delay suggested to a refused request.
    """

    def __init__(self, max_total: int, max_per_key: int, retry_after_s: float = 1.0) -> None:
        self._max_total = max_total
        self._max_per_key = max_per_key
        self._retry_after_s = retry_after_s
        self._num_total = 0
        self._num_per_key: dict[bytes, int] = {}

    @property
    def num_in_flight(self) -> int:
        """Requests admitted and not yet released."""
        return self._num_total

    def admit(self, api_key: str | None) -> Admission:
        """Admits a request of `api_key` (the key it presented, or None).

        Raises:
            PdserveError: RATE_LIMITED when the key or the gateway is at its limit.
        """
        key = _key(api_key)
        num_for_key = self._num_per_key.get(key, 0)
        if num_for_key >= self._max_per_key:
            raise self._refusal(f"too many requests in flight for this API key ({num_for_key})")
        if self._num_total >= self._max_total:
            raise self._refusal(f"too many requests in flight on the gateway ({self._num_total})")
        self._num_per_key[key] = num_for_key + 1
        self._num_total += 1
        return Admission(self, key)

    def _refusal(self, message: str) -> PdserveError:
        return PdserveError(
            ErrorReason.RATE_LIMITED, message + "; retry later", retry_delay_s=self._retry_after_s
        )

    def _release(self, key: bytes) -> None:
        self._num_total -= 1
        remaining = self._num_per_key[key] - 1
        if remaining:
            self._num_per_key[key] = remaining
        else:
            del self._num_per_key[key]
