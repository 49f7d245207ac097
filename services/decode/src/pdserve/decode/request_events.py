"""How a decode request's events reach its Generate stream: queued on the event loop, from
the decode thread or once a pending write lands.

`RequestEvents` is the part of `DecodeRequest` that delivers: the decode thread calls `emit`
(or `emit_when_done`, for an event that waits for an offload), which hops to the event loop and
`deliver`s; the stream reads with `next_events`, and a stream taken over by a resume sees
`is_current` turn False. Every delivery or takeover wakes the waiters of `change_waiter`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import Future

from pdserve.decode.events import DecodeEvent, TokensEvent

_PENDING: set[asyncio.Future[None]] = set()  # notices waiting for their offload (keep a ref)


class RequestEvents:
    """The event queue of one request and its delivery (a base of `DecodeRequest`, which
    declares these attributes as fields).

    Attributes:
        attach_epoch: How many streams attached so far; the current one owns the request.
        terminal: Its terminal event once delivered.
        events: Its events, waiting for (or read by) the Generate stream.
        ready: Set once committed or ended: a Generate stream may start reading.
    """

    attach_epoch: int
    terminal: DecodeEvent | None
    events: asyncio.Queue[DecodeEvent]
    ready: asyncio.Event
    _aio_loop: asyncio.AbstractEventLoop | None
    _changed: asyncio.Event

    def is_current(self, epoch: int) -> bool:
        """Whether the stream attached with `epoch` still owns the request."""
        return self.attach_epoch == epoch

    def change_waiter(self) -> asyncio.Event:
        """An event set at the next delivery or takeover (take it before reading the state
        it guards, wait on it after)."""
        return self._changed

    async def next_events(self, epoch: int | None = None) -> list[DecodeEvent]:
        """Every queued event, waiting for at least one; none once the stream attached with
        `epoch` was taken over (None: the caller cannot be taken over)."""
        while self.events.empty():
            if epoch is not None and not self.is_current(epoch):
                return []
            await self._changed.wait()
        if epoch is not None and not self.is_current(epoch):
            return []
        return self.take_events()

    def take_events(self) -> list[DecodeEvent]:
        """Every queued event, without waiting (a resumed stream drops them: it reads
        ``token_ids`` and ``terminal`` instead)."""
        events = []
        while not self.events.empty():
            events.append(self.events.get_nowait())
        return events

    def deliver(self, event: DecodeEvent) -> None:
        """Queues an event for the Generate stream (on the event loop); records a terminal
        one in ``terminal``."""
        if not isinstance(event, TokensEvent) and self.terminal is None:
            self.terminal = event
        self.events.put_nowait(event)
        self.ready.set()
        self._wake()

    def _wake(self) -> None:
        # NOTE: a broadcast: every waiter of the current event wakes, later waiters wait on
        # a fresh one (asyncio.Event has no pulse).
        self._changed.set()
        self._changed = asyncio.Event()

    def emit(self, event: DecodeEvent) -> None:
        """Queues an event from the decode thread (it hops to the event loop)."""
        assert self._aio_loop is not None, "emit() before start_generation()"
        with contextlib.suppress(RuntimeError):  # the event loop is closed: shutting down
            self._aio_loop.call_soon_threadsafe(self.deliver, event)

    def emit_when_done(
        self,
        future: Future[int],
        timeout_s: float,
        make_event: Callable[[Future[int] | None], DecodeEvent],
    ) -> None:
        """Emits ``make_event(future)`` once `future` resolves, or ``make_event(None)`` after
        `timeout_s`, whichever comes first (from any thread; events emitted before this call
        are delivered before it)."""
        assert self._aio_loop is not None, "emit_when_done() before start_generation()"

        def schedule() -> None:
            task = asyncio.ensure_future(self._deliver_when_done(future, timeout_s, make_event))
            _PENDING.add(task)
            task.add_done_callback(_PENDING.discard)

        with contextlib.suppress(RuntimeError):  # the event loop is closed: shutting down
            self._aio_loop.call_soon_threadsafe(schedule)

    async def _deliver_when_done(
        self,
        future: Future[int],
        timeout_s: float,
        make_event: Callable[[Future[int] | None], DecodeEvent],
    ) -> None:
        waited = asyncio.wrap_future(future)
        # NOTE: a write that lands after the wait still resolves `waited`; retrieve its error.
        waited.add_done_callback(lambda f: f.cancelled() or f.exception())
        done, _ = await asyncio.wait({waited}, timeout=timeout_s)
        self.deliver(make_event(future if done else None))
