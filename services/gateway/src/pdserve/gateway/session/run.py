"""One resumable request held by this gateway: every delta it made, kept so that any number of
clients can follow it from the start or from where they left off; a client that goes away only
stops following."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from pdserve.common.errors import PdserveError
from pdserve.gateway.prepare.params import PreparedRequest
from pdserve.gateway.request import OutputDelta, ResponseStatus, Resumable
from pdserve.gateway.session.store import ResumeRecord


class RunMoved(Exception):
    """Another gateway took the run over: its followers here should reconnect."""


class Run:
    """One resumable request held by this gateway.

    Attributes:
        record: Its record (as last written by this gateway).
        prepared: The prepared request.
        deltas: Every delta so far (one token each, then the final delta).
        error: How it failed (or was cancelled); None while it runs or once it finished.
        is_done: It ended here (finished, failed, cancelled or moved).
        is_moved: Another gateway took it over (or this one left it to the others).
        task: The task that drives it.
        resumable: How it runs (its placements announced; left to others on a stop).
        parsed: The body as its front end parsed it (kept by its session, so a client that
            follows it here does not parse it again); None until set.
        last_write: Its latest record write, which the next one waits for.
    """

    def __init__(self, record: ResumeRecord, prepared: PreparedRequest) -> None:
        self.record = record
        self.prepared = prepared
        self.deltas: list[OutputDelta] = []
        self.error: PdserveError | None = None
        self.is_done = False
        self.is_moved = False
        self.task: asyncio.Task[None] | None = None
        self.resumable: Resumable | None = None
        self.parsed: object | None = None
        self.last_write: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()

    @property
    def request_id(self) -> str:
        return self.record.request_id

    @property
    def status(self) -> ResponseStatus:
        """``in_progress``, or how it ended (``completed``, ``incomplete``, ``failed``,
        ``cancelled``)."""
        if self.record.end is not None:
            return self.record.end.status
        return ResponseStatus.IN_PROGRESS

    def add(self, delta: OutputDelta) -> None:
        """Keeps `delta` and wakes the followers."""
        self.deltas.append(delta)
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def done(self) -> None:
        """Marks it ended and wakes the followers."""
        self.is_done = True
        self._wake()

    async def follow(self) -> AsyncGenerator[OutputDelta, None]:
        """Its deltas from the first, live until it ends (positions are the session's:
        `pdserve.gateway.session.positions`).

        Raises:
            PdserveError: How it failed (after the deltas it made).
            RunMoved: Another gateway took it over (the client should resume there).
        """
        index = 0
        while True:
            changed = self._changed
            while index < len(self.deltas):
                yield self.deltas[index]
                index += 1
            if self.is_done:
                if self.is_moved:
                    raise RunMoved(self.request_id)
                if self.error is not None:
                    raise self.error
                return
            await changed.wait()
