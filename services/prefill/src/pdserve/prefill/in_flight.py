"""One prefill request in flight: the request, and what runs it on the event loop.

`Handoffs` makes an `InFlight` for each request it starts and keeps it while the request is
live: the outbox its caller reads, the future of its first token, its KV sender and the tasks
that run the request, its transfer and its cleanup. The engine thread's events about the
request reach it through `engine_sink` (they hop to the event loop): KV pieces go to the
sender, the first token (or the engine's failure) resolves the future.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.kv.transfer import KvPiece
from pdserve.prefill.events import (
    EngineEvent,
    EngineFailed,
    EventSink,
    FirstTokenSampled,
    Outcome,
)
from pdserve.prefill.kv.sender import KvSender
from pdserve.prefill.leasing import WindowPlace
from pdserve.prefill.request import Request


@dataclass(eq=False)
class InFlight:
    """One request on its way to a handoff, and what its handoff holds for it.

    Attributes:
        request: The request (its state and its transitions).
        outbox: What its caller reads: `Outcome`s (the first token, then a handoff, a finish
            or a `PdserveError`).
        first_token: Resolved by the engine thread's first token (made by `engine_sink`).
        window_place: Its place in the lease window, from its turn until its prompt is
            computed (`leasing.LeaseWindow`).
        sender: Its KV sender once a lease is granted; ``sender_task`` runs it.
        task: The event-loop task that walks the request through its states;
            ``cleanup_task`` releases what it holds.
    """

    request: Request
    outbox: asyncio.Queue[Outcome] = field(default_factory=asyncio.Queue)
    first_token: asyncio.Future[FirstTokenSampled] | None = None
    window_place: WindowPlace | None = None
    sender: KvSender | None = None
    sender_task: asyncio.Task[object] | None = None
    task: asyncio.Task[None] | None = None
    cleanup_task: asyncio.Task[None] | None = None

    @property
    def is_ending(self) -> bool:
        """Aborted or ended: only its cleanup (releasing its lease and blocks) may still run."""
        task = self.task
        return task is None or task.done() or task.cancelling() > 0

    def engine_sink(self) -> EventSink:
        """What the engine thread calls with its events (they hop to the running event loop)."""
        aio_loop = asyncio.get_running_loop()
        self.first_token = aio_loop.create_future()

        def sink(event: EngineEvent) -> None:
            with contextlib.suppress(RuntimeError):  # the event loop is closed: shutting down
                aio_loop.call_soon_threadsafe(self.on_engine_event, event)

        return sink

    def on_engine_event(self, event: EngineEvent) -> None:
        """Dispatches an engine-thread event (runs on the event loop)."""
        assert self.first_token is not None
        request = self.request
        if isinstance(event, KvPiece):
            if self.sender is not None and not request.status.is_terminal:
                self.sender.put(event)
        elif self.first_token.done() or request.status.is_terminal:
            return
        elif isinstance(event, FirstTokenSampled):
            # NOTE: when it was sampled, not when the (possibly busy) event loop saw it.
            request.phases.first_token = event.sampled_at or time.monotonic()
            self.first_token.set_result(event)
        elif isinstance(event, EngineFailed):
            self.first_token.set_exception(PdserveError(event.reason, event.detail))

    async def wait_first_token(self) -> FirstTokenSampled:
        """The first token; fails early if the transfer broke before it was sampled."""
        assert self.first_token is not None
        waiters: set[asyncio.Future[object]] = {self.first_token}  # type: ignore[arg-type]
        if self.sender_task is not None:
            waiters.add(self.sender_task)
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        if self.first_token.done():
            return self.first_token.result()
        assert self.sender_task is not None
        self.sender_task.result()  # raises the transfer's error
        raise PdserveError(ErrorReason.INTERNAL, "the transfer ended before the first token")
