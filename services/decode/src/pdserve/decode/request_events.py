"""What a decode request tells its Generate stream: its events, queued on the event loop, from
the decode thread or once a pending write lands.

Each `DecodeRequest` owns one `RequestEvents` (its ``events``): the decode thread calls `emit`
(or `emit_when_done`, for an event that waits for an offload), which hops to the event loop and
`deliver`s; the stream reads with `next_events`, and a stream taken over by a resume (a new
epoch, `new_epoch`) sees `is_current` turn False. Every delivery or takeover wakes the waiters
of `change_waiter`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import Future

from pdserve.decode.events import DecodeEvent, TokensEvent

_PENDING: set[asyncio.Future[None]] = set()  # notices waiting for their offload (keep a ref)


class RequestEvents:
    """The event queue of one request, its delivery, and which stream owns it.

    Attributes:
        attach_epoch: How many streams attached so far (resumes included); the stream
            attached with the current number owns the request, an older one was taken over.
        terminal: Its terminal event once delivered (kept so that a resumed stream can replay
            it after another stream consumed it from the queue).
        ready: Set once committed or ended: a Generate stream may start reading.
    """

    def __init__(self) -> None:
        self.attach_epoch = 0
        self.terminal: DecodeEvent | None = None
        self.ready = asyncio.Event()
        self._queue: asyncio.Queue[DecodeEvent] = asyncio.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed = asyncio.Event()

    def __repr__(self) -> str:
        return f"RequestEvents(attach_epoch={self.attach_epoch}, queued={self._queue.qsize()})"

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Sets the event loop `emit` hops to (the request's generation starts on it)."""
        self._loop = loop

    def new_epoch(self) -> int:
        """A stream attaches: returns its epoch; the stream that owned the request (if any)
        is taken over and sees it at once."""
        self.attach_epoch += 1
        self._wake()
        return self.attach_epoch

    def is_empty(self) -> bool:
        """Whether no event waits in the queue."""
        return self._queue.empty()

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
        while self._queue.empty():
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
        while not self._queue.empty():
            events.append(self._queue.get_nowait())
        return events

    def deliver(self, event: DecodeEvent) -> None:
        """Queues an event for the Generate stream (on the event loop); records a terminal
        one in ``terminal``."""
        if not isinstance(event, TokensEvent) and self.terminal is None:
            self.terminal = event
        self._queue.put_nowait(event)
        self.ready.set()
        self._wake()

    def _wake(self) -> None:
        # NOTE: a broadcast: every waiter of the current event wakes, later waiters wait on
        # a fresh one (asyncio.Event has no pulse).
        self._changed.set()
        self._changed = asyncio.Event()

    def emit(self, event: DecodeEvent) -> None:
        """Queues an event from the decode thread (it hops to the event loop)."""
        assert self._loop is not None, "emit() before the request's generation started"
        with contextlib.suppress(RuntimeError):  # the event loop is closed: shutting down
            self._loop.call_soon_threadsafe(self.deliver, event)

    def emit_when_done(
        self,
        future: Future[int],
        timeout_s: float,
        make_event: Callable[[Future[int] | None], DecodeEvent],
    ) -> None:
        """Emits ``make_event(future)`` once `future` resolves, or ``make_event(None)`` after
        `timeout_s`, whichever comes first (from any thread; events emitted before this call
        are delivered before it)."""
        assert self._loop is not None, "emit_when_done() before the generation started"

        def schedule() -> None:
            task = asyncio.ensure_future(self._deliver_when_done(future, timeout_s, make_event))
            _PENDING.add(task)
            task.add_done_callback(_PENDING.discard)

        with contextlib.suppress(RuntimeError):  # the event loop is closed: shutting down
            self._loop.call_soon_threadsafe(schedule)

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
