"""One prefill request as the event loop holds it: what its caller reads, what it holds.

The engine thread owns a `Request` while it computes it; `RequestTask` is the event-loop side:
the outbox the servicer streams from (`Outcome`s: the first token, then a handoff or a finish,
or a `PdserveError`), the first-token future, the KV sender, whether a decode lease is still
open, and `release()`, which gives all of it back.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import FinishReason
from pdserve.prefill.decode_client import DecodePeers
from pdserve.prefill.kv_sender import KvSender
from pdserve.prefill.prefill_loop import PrefillLoop
from pdserve.prefill.request import (
    EngineEvent,
    EngineFailed,
    FirstTokenSampled,
    LeaseGrant,
    Request,
)
from pdserve.serving.kv_transfer import KvPiece

log = structlog.get_logger(__name__)

RELEASE_WAIT_S = 30.0


@dataclass(frozen=True)
class FirstTokenOut:
    """The first token, for the caller (sent before the transfer finishes)."""

    token_id: int
    index: int


@dataclass(frozen=True)
class HandedOffOut:
    """Terminal: the decode committed the KV and owns the request."""

    lease: LeaseGrant
    num_chunks: int
    num_bytes: int


@dataclass(frozen=True)
class FinishedOut:
    """Terminal: the first token ended the request; no decode runs."""

    reason: FinishReason
    num_prompt_tokens: int
    num_completion_tokens: int


Outcome = FirstTokenOut | HandedOffOut | FinishedOut | PdserveError


@dataclass(eq=False)
class RequestTask:
    """The event-loop side of one request."""

    request: Request
    outbox: asyncio.Queue[Outcome] = field(default_factory=asyncio.Queue)
    first_token: asyncio.Future[int] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    sender: KvSender | None = None
    sender_task: asyncio.Task[object] | None = None
    task: asyncio.Task[None] | None = None
    cleanup_task: asyncio.Task[None] | None = None
    is_lease_open: bool = False
    is_submitted: bool = False

    def engine_sink(self) -> Callable[[EngineEvent], None]:
        """What the engine thread calls with this request's events (they hop to this loop)."""
        aio_loop = asyncio.get_running_loop()

        def sink(event: EngineEvent) -> None:
            with contextlib.suppress(RuntimeError):  # the event loop is closed: shutting down
                aio_loop.call_soon_threadsafe(self.on_engine_event, event)

        return sink

    def on_engine_event(self, event: EngineEvent) -> None:
        """Dispatches an engine-thread event (runs on the event loop)."""
        if isinstance(event, KvPiece):
            if self.sender is not None and not self.request.status.is_terminal:
                self.sender.put(event)
        elif self.first_token.done() or self.request.status.is_terminal:
            return
        elif isinstance(event, FirstTokenSampled):
            self.first_token.set_result(event.token_id)
        elif isinstance(event, EngineFailed):
            self.first_token.set_exception(PdserveError(ErrorReason.INTERNAL, event.detail))

    async def wait_first_token(self) -> int:
        """The first token; fails early if the transfer broke before it was sampled."""
        waiters: set[asyncio.Future[object]] = {self.first_token}  # type: ignore[arg-type]
        if self.sender_task is not None:
            waiters.add(self.sender_task)
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        if self.first_token.done():
            return self.first_token.result()
        assert self.sender_task is not None
        self.sender_task.result()  # raises the transfer's error
        raise PdserveError(ErrorReason.INTERNAL, "the transfer ended before the first token")

    async def release_lease(self, peers: DecodePeers) -> None:
        """Releases the decode lease unless it was handed off or released already."""
        request = self.request
        if not self.is_lease_open or request.lease is None:
            return
        self.is_lease_open = False
        await peers.release_lease(
            request.decode_address, request.lease.lease_id, request.request_id
        )

    async def release(self, peers: DecodePeers, loop: PrefillLoop) -> None:
        """Gives back what the request holds: the decode lease unless handed off, the SyncCache
        stream, and the prefill's blocks (freed on the engine thread)."""
        if self.is_lease_open:
            # NOTE: release before cancelling the stream, so the decode ends the lease as
            # released rather than as a broken transfer.
            await self.release_lease(peers)
        if self.sender_task is not None:
            self.sender_task.cancel()
            with contextlib.suppress(BaseException):
                await self.sender_task
        if self.is_submitted:
            await self._free_blocks(loop)

    async def _free_blocks(self, loop: PrefillLoop) -> None:
        aio_loop = asyncio.get_running_loop()
        released = aio_loop.create_future()

        def on_released() -> None:
            with contextlib.suppress(RuntimeError):
                aio_loop.call_soon_threadsafe(_resolve, released)

        loop.release(self.request, on_released)
        try:
            await asyncio.wait_for(released, RELEASE_WAIT_S)
        except TimeoutError:
            log.error("prefill_blocks_not_released", request_id=self.request.request_id)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
