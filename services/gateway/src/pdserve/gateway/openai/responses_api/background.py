"""Background responses: created, polled, streamed from any point, cancelled and deleted, on
any gateway that shares the store of resumable requests.

``POST /v1/responses`` with ``background: true`` answers at once (``queued``; streamed: its
events as they come) while the response runs in this gateway as a background session
(`pdserve.gateway.session`).
``GET /v1/responses/{id}`` answers the response as it stands; with ``stream=true`` its events
from ``starting_after`` + 1 on, live until the end. Every event is a function of the
response's tokens (one delta per token), so a gateway that never saw the response makes the
same events again and sends only the ones after ``starting_after``:

* a response this gateway holds: its deltas so far;
* one that ended: its tokens from the store;
* one still running that another gateway holds or held: a stream is taken over (the decode
  replays its tokens to this gateway, which holds it from then on); a plain ``GET`` reads the
  tokens so far from the decode without taking anything over.

Only the API key that created a response reads, streams, cancels or deletes it; to any other
key (and for unknown or expired ids) it does not exist (404).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from pdserve.gateway.access.auth import Caller
from pdserve.gateway.openai.responses_api.convert import ResponsesBody, parse_responses_body
from pdserve.gateway.openai.responses_api.snapshots import (
    events_after,
    response_snapshot,
    writer_of,
)
from pdserve.gateway.openai.responses_api.writer import ResponseWriter, request_id_of
from pdserve.gateway.prepare.validation import RequestLimits
from pdserve.gateway.prepare.workers import ParserPool
from pdserve.gateway.request import ApiKind, ResponseStatus
from pdserve.gateway.session.access import not_found
from pdserve.gateway.session.session import Parsed, Session
from pdserve.gateway.session.sessions import Sessions

KINDS = (ApiKind.RESPONSES,)


class BackgroundResponses:
    """Background responses: the Responses API's reading of kept sessions.

    Args:
        sessions: Finds, follows, cancels and deletes them (able to keep requests).
        parser: Parses a stored body.
        limits: What one request may ask for (a stored body is checked again).
    """

    def __init__(self, sessions: Sessions, parser: ParserPool, limits: RequestLimits) -> None:
        self._sessions = sessions
        self._parser = parser
        self._limits = limits
        sessions.parse_stored_with(ApiKind.RESPONSES, self._parse)

    def queued(self, session: Session) -> dict[str, Any]:
        """The answer to a non-streamed create: the response, queued."""
        return _writer(session).response(ResponseStatus.QUEUED)

    def events(
        self, session: Session, starting_after: int | None = None
    ) -> AsyncGenerator[str, None]:
        """A session's events after sequence number `starting_after` (all: None), live.

        The events are numbered by sequence number, not by token: the writer makes them
        from every delta of the session (from position 0), and only those after
        `starting_after` are sent.
        """
        return events_after(_writer(session).events(None, session.deltas()), starting_after)

    async def retrieve(self, response_id: str, caller: Caller) -> dict[str, Any]:
        """The response as it stands (its output so far while it runs)."""
        request_id = self._request_id(response_id)
        found = await self._sessions.snapshot(request_id, KINDS, caller, self._parse, response_id)
        assert isinstance(found.body, ResponsesBody)
        writer = writer_of(found.prepared, found.body, found.record)
        return response_snapshot(writer, found.deltas, found.status, found.error)

    async def stream(
        self, response_id: str, caller: Caller, starting_after: int | None
    ) -> AsyncGenerator[str, None]:
        """The response's events after sequence number `starting_after` (all: None), live
        until it ends; a running response another gateway held is taken over."""
        request_id = self._request_id(response_id)
        session = await self._sessions.resume(request_id, KINDS, caller, self._parse, response_id)
        return self.events(session, starting_after)

    async def cancel(self, response_id: str, caller: Caller) -> dict[str, Any]:
        """Cancels a running response (its lease is released); an ended one stays as it is."""
        request_id = self._request_id(response_id)
        await self._sessions.cancel(request_id, KINDS, caller, response_id)
        return await self.retrieve(response_id, caller)

    async def delete(self, response_id: str, caller: Caller) -> dict[str, Any]:
        """Forgets a response (cancelling it first if it runs here)."""
        request_id = self._request_id(response_id)
        await self._sessions.delete(request_id, KINDS, caller, response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    def _request_id(self, response_id: str) -> str:
        request_id = request_id_of(response_id)
        if request_id is None:
            raise not_found(ApiKind.RESPONSES, response_id)
        return request_id

    async def _parse(self, raw: bytes) -> Parsed:
        body = await self._parser.run(parse_responses_body, len(raw), raw, self._limits)
        return Parsed(body, body.params)


def _writer(session: Session) -> ResponseWriter:
    assert isinstance(session.body, ResponsesBody) and session.record is not None
    return writer_of(session.prepared, session.body, session.record)
