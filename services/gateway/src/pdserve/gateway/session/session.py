"""One request as a front end holds it: its prepared request, its record when it is kept, and
its deltas in one position numbering (`pdserve.gateway.session.positions`)."""

from __future__ import annotations

import base64
import enum
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import NamedTuple

from pdserve.common.errors import PdserveError
from pdserve.gateway.prepare.params import GenerationParams, PreparedRequest
from pdserve.gateway.request import ApiKind, OutputDelta, ResponseStatus
from pdserve.gateway.session.access import replay_end
from pdserve.gateway.session.positions import Step, deltas_after, steps_after
from pdserve.gateway.session.run import Run
from pdserve.gateway.session.store import ResumeRecord


class SessionMode(enum.StrEnum):
    """How a request runs.

    Attributes:
        PLAIN: For its client alone: it stops when the client goes away.
        RESUMABLE: A stream kept in the store: a client that goes away only stops following
            it, and any gateway sharing the store resumes it.
        BACKGROUND: Kept like a resumable stream; its client need not follow it at all (a
            background response).
        STORED: Runs as a plain one; once it ended, its record is written, so that any
            gateway sharing the store reads it after (a stored response, which the next turn
            of a conversation continues by ``previous_response_id``).
    """

    PLAIN = "plain"
    RESUMABLE = "resumable"
    BACKGROUND = "background"
    STORED = "stored"

    @property
    def is_kept(self) -> bool:
        """It runs on without its client (its client only follows it)."""
        return self in (SessionMode.RESUMABLE, SessionMode.BACKGROUND)


class Snapshot(NamedTuple):
    """A kept request as it stands, read without following or taking it over.

    Attributes:
        record: Its record.
        prepared: Its prepared request.
        body: Its body as the front end parsed it.
        deltas: Its deltas so far (with the final one once it finished).
        status: Where it stands.
        error: How it failed or was cancelled; None otherwise.
    """

    record: ResumeRecord
    prepared: PreparedRequest
    body: object
    deltas: list[OutputDelta]
    status: ResponseStatus
    error: PdserveError | None


class Parsed(NamedTuple):
    """A stored body as its front end parses it again.

    Attributes:
        body: The front end's parsed body (what its writer reads: model name, options).
        params: What the request asks for, to prepare it again.
    """

    body: object
    params: GenerationParams


def stored_body(kind: ApiKind, raw: bytes) -> str:
    """A request's body as its record keeps it: JSON text, a gRPC message's bytes in base64."""
    return base64.b64encode(raw).decode() if kind is ApiKind.GRPC else raw.decode()


def raw_body(record: ResumeRecord) -> bytes:
    """The body a record keeps, as the client sent it (`stored_body` undone)."""
    if record.kind is ApiKind.GRPC:
        return base64.b64decode(record.body)
    return record.body.encode()


class Session:
    """One request of any API and mode, opened or resumed by
    `pdserve.gateway.session.sessions.Sessions`.

    Args:
        kind: The API that took it.
        prompts: Its prepared requests (one per prompt of a completions prompt list).
        source: Makes its deltas from the start, as ``(choice index, delta)``.
        run: This gateway's run of it (a kept request running or ended here); None otherwise.
        record: Its record (a kept or stored request); None for a plain one.
        body: Its body as the front end parsed it (a kept or stored request); None otherwise.

    Attributes:
        kind: The API that took it.
        prompts: Its prepared requests.
        run: This gateway's run of it, or None.
        body: Its parsed body, or None.
    """

    def __init__(
        self,
        kind: ApiKind,
        prompts: Sequence[PreparedRequest],
        source: Callable[[], AsyncGenerator[tuple[int, OutputDelta], None]],
        run: Run | None = None,
        record: ResumeRecord | None = None,
        body: object | None = None,
    ) -> None:
        self.kind = kind
        self.prompts = list(prompts)
        self.run = run
        self.body = body
        self._record = record
        self._source = source

    @property
    def request_id(self) -> str:
        """The gateway's id of the request (of its first prompt)."""
        return self.prompts[0].request_id

    @property
    def prepared(self) -> PreparedRequest:
        """Its (first) prepared request."""
        return self.prompts[0]

    @property
    def record(self) -> ResumeRecord | None:
        """Its record as last known here (a run's is current); None for a plain request."""
        return self.run.record if self.run is not None else self._record

    @record.setter
    def record(self, record: ResumeRecord) -> None:
        """A stored request's record, once written with its end."""
        self._record = record

    def clock(self) -> float:
        """The time now, until the request's stored end; then the end's time (a stored
        response's ``completed_at`` as any gateway reads it)."""
        record = self.record
        if record is not None and record.end is not None:
            return record.end.completed_at
        return time.time()

    @property
    def created_at(self) -> float | None:
        """When a kept request was created (its record's); None for a plain one."""
        record = self.record
        return None if record is None else record.created_at

    def steps(self, after: int | None = None) -> AsyncGenerator[Step, None]:
        """Every delta from the start, each marked whether a client at position `after`
        (None: from the start) still needs it; live until the request ends.

        Raises:
            PdserveError: How the request failed (after its deltas).
            RunMoved: Another gateway took it over (the client resumes there).
        """
        return steps_after(self._source(), after)

    def deltas(self, after: int | None = None) -> AsyncGenerator[tuple[int, OutputDelta], None]:
        """The deltas a client at position `after` (None: from the start) still needs, as
        ``(choice index, delta)``; past the end, the end. Raises as `steps`.

        A plain request runs while its deltas are read: read them once.
        """
        if after is None:
            return self._source()  # NOTE: all of them: nothing to step over on each token
        return deltas_after(self._source(), after)


def followed(kind: ApiKind, run: Run) -> Session:
    """The session of a run held here: its deltas followed live."""

    async def source() -> AsyncGenerator[tuple[int, OutputDelta], None]:
        deltas = run.follow()
        try:
            async for delta in deltas:
                yield 0, delta
        finally:
            await deltas.aclose()

    return Session(kind, [run.prepared], source, run=run, body=run.parsed)


def replayed(record: ResumeRecord, prepared: PreparedRequest, body: object) -> Session:
    """The session of a request that ended (on any gateway): its deltas made again from its
    stored end (a failed or cancelled one's error after them)."""
    end = record.end
    assert end is not None

    async def source() -> AsyncGenerator[tuple[int, OutputDelta], None]:
        async for delta in replay_end(prepared, end):
            yield 0, delta

    return Session(record.kind, [prepared], source, record=record, body=body)
