"""What an attempt left behind on its instances, given back in background tasks.

An attempt left early (a setback, the consumer closing the stream, a client disconnect) aborts
its prefill request and releases its decode lease; the calls run as tasks of their own, so
they are sent even from a cancelled task, and their failures are only logged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import structlog
from opentelemetry.context import Context

from pdserve.gateway.fleet.backend import Backend, BackendError

log = structlog.get_logger("pdserve.gateway.attempt")


class Cleanups:
    """AbortRequest and ReleaseLease calls in background tasks.

    Args:
        backend: Calls to prefill and decode instances.
        timeout_s: Deadline of each call.
    """

    def __init__(self, backend: Backend, timeout_s: float) -> None:
        self._backend = backend
        self._timeout_s = timeout_s
        self._tasks: set[asyncio.Task[None]] = set()
        # NOTE: request id -> its AbortRequest still on the way to a prefill.
        self._aborting: dict[str, asyncio.Task[None]] = {}

    async def wait(self) -> None:
        """Waits until every background AbortRequest / ReleaseLease has finished."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def wait_for_abort(self, request_id: str) -> None:
        """Waits (within the cleanup deadline) for the request's AbortRequest in flight.

        The next attempt reuses the request id, possibly on the same prefill: an AbortRequest
        of the previous one that arrived after it started would cancel it.
        """
        task = self._aborting.get(request_id)
        if task is not None:
            await asyncio.wait([task], timeout=self._timeout_s)

    def abort(self, address: str, request_id: str, context: Context) -> None:
        """Sends AbortRequest for `request_id` to the prefill at `address`."""
        aborting = self._backend.abort_request(address, request_id, self._timeout_s, context)
        task = self._spawn(aborting, "abort_request", request_id)
        self._aborting[request_id] = task
        task.add_done_callback(lambda _: self._forget_abort(request_id, task))

    def release(self, address: str, lease_id: str, request_id: str, context: Context) -> None:
        """Sends ReleaseLease for `lease_id` to the decode at `address`."""
        releasing = self._backend.release_lease(
            address, lease_id, request_id, self._timeout_s, context
        )
        self._spawn(releasing, "release_lease", request_id)

    def _forget_abort(self, request_id: str, task: asyncio.Task[None]) -> None:
        if self._aborting.get(request_id) is task:
            del self._aborting[request_id]

    def _spawn(
        self, coro: Coroutine[Any, Any, None], what: str, request_id: str
    ) -> asyncio.Task[None]:
        async def run() -> None:
            try:
                await coro
            except BackendError as failure:
                log.debug("cleanup_failed", request_id=request_id, call=what, error=str(failure))

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        log.debug("cleanup_sent", request_id=request_id, call=what)
        return task
