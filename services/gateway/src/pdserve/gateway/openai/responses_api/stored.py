"""Stored responses: a response is kept once it ended (``store``, true unless the client says
false), a background one also while it runs, on any gateway that shares the store of kept
requests. A stored response is read back, and the next turn of its conversation continues it
by ``previous_response_id``.

``POST /v1/responses`` with ``background: true`` answers at once (``queued``; streamed: its
events as they come) while the response runs in this gateway as a background session
(`pdserve.gateway.session`); any other stored response runs for its client and is written
to the store as it ends, before its client has its end.
``GET /v1/responses/{id}`` answers the response as it stands; with ``stream=true`` its events
from ``starting_after`` + 1 on, live until the end. Every event is a function of the
response's tokens (one delta per token), so a gateway that never saw the response makes the
same events again and sends only the ones after ``starting_after``:

* a response this gateway holds: its deltas so far;
* one that ended: its tokens from the store;
* one still running that another gateway holds or held: a stream is taken over (the decode
  replays its tokens to this gateway, which holds it from then on); a plain ``GET`` reads the
  tokens so far from the decode without taking anything over.

``GET /v1/responses/{id}/input_items`` lists what the response was given: its input items,
those of the conversation it continued first.

A request with ``previous_response_id`` is given the conversation of that response before its
own input (`StoredResponses.continued`): that response's input items, then its output items,
made again from its tokens as a ``GET`` makes them (a call's ``call_id`` is the one its client
saw: `pdserve.gateway.tool_deltas.call_id`). The body kept for it holds the whole
conversation, so a stored turn never needs the turns before it.

Only the API key that created a response reads, streams, cancels or deletes it, or continues
it; to any other key (and for unknown or expired ids) it does not exist (404; 400 naming
``previous_response_id`` for a continuation).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.gateway.access.auth import Caller
from pdserve.gateway.openai.responses_api.convert import ResponsesBody, parse_responses_body
from pdserve.gateway.openai.responses_api.snapshots import (
    events_after,
    response_snapshot,
    writer_of,
)
from pdserve.gateway.openai.responses_api.writer import ResponseWriter, request_id_of
from pdserve.gateway.prepare.validation import RequestLimits, invalid
from pdserve.gateway.prepare.workers import ParserPool
from pdserve.gateway.request import ApiKind, ResponseStatus
from pdserve.gateway.session.access import Lookup
from pdserve.gateway.session.session import Parsed, Session, raw_body
from pdserve.gateway.session.sessions import Sessions
from pdserve.gateway.session.store import ResumeRecord

log = structlog.get_logger("pdserve.gateway.openai.responses_api.stored")

KINDS = (ApiKind.RESPONSES,)


class StoredResponses:
    """Stored and background responses: the Responses API's reading of kept and stored
    sessions, and the conversations that continue them.

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
        _, response = await self._read(response_id, caller)
        return response

    async def _read(self, response_id: str, caller: Caller) -> tuple[ResumeRecord, dict[str, Any]]:
        """The response's record, and the response as it stands."""
        found = await self._sessions.snapshot(self._lookup(response_id, caller), self._parse)
        assert isinstance(found.body, ResponsesBody)
        writer = writer_of(found.prepared, found.body, found.record)
        return found.record, response_snapshot(writer, found.deltas, found.status, found.error)

    async def stream(
        self, response_id: str, caller: Caller, starting_after: int | None
    ) -> AsyncGenerator[str, None]:
        """The response's events after sequence number `starting_after` (all: None), live
        until it ends; a running response another gateway held is taken over."""
        session = await self._sessions.resume(self._lookup(response_id, caller), self._parse)
        return self.events(session, starting_after)

    async def cancel(self, response_id: str, caller: Caller) -> dict[str, Any]:
        """Cancels a running response (its lease is released); an ended one stays as it is."""
        await self._sessions.cancel(self._lookup(response_id, caller))
        return await self.retrieve(response_id, caller)

    async def delete(self, response_id: str, caller: Caller) -> dict[str, Any]:
        """Forgets a response (cancelling it first if it runs here)."""
        await self._sessions.delete(self._lookup(response_id, caller))
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def continued(self, raw: bytes, caller: Caller) -> tuple[bytes, int]:
        """`raw` with the conversation of the response its ``previous_response_id`` names
        before its input (`raw` as it is without one, or where the parser will refuse it),
        and how many items that conversation put there (`as_sent` names the client's).

        Raises:
            PdserveError: INVALID_REQUEST naming ``previous_response_id`` for a response that
                does not exist for `caller` (unknown, expired, not stored, another key's) or
                has not ended well (running, failed, cancelled); PEER_UNAVAILABLE.
        """
        try:
            data = json.loads(raw)
        except ValueError:
            return raw, 0
        previous = data.get("previous_response_id") if isinstance(data, dict) else None
        current = _as_items(data.get("input")) if isinstance(previous, str) else None
        if current is None:
            return raw, 0
        assert isinstance(previous, str)
        earlier = await self._conversation(previous, caller)
        data["input"] = earlier + current
        log.info(
            "response_continued", previous_response_id=previous, num_earlier_items=len(earlier)
        )
        return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode(), len(earlier)

    async def _conversation(self, response_id: str, caller: Caller) -> list[Any]:
        """A stored response's conversation: its input items, then its output items."""
        try:
            record, response = await self._read(response_id, caller)
        except PdserveError as error:
            if error.reason is not ErrorReason.REQUEST_NOT_FOUND:
                raise
            raise invalid(
                f"no stored response with id {response_id[:200]!r} (unknown, expired, sent "
                "with store: false, or another key's)",
                PREVIOUS,
            ) from None
        status = response["status"]
        if status not in (ResponseStatus.COMPLETED, ResponseStatus.INCOMPLETE):
            raise invalid(
                f"response {response_id[:200]!r} is {status}: only a response that ended "
                "(completed or incomplete) can be continued",
                PREVIOUS,
            )
        earlier = _as_items(json.loads(raw_body(record)).get("input")) or []
        return earlier + list(response["output"])

    async def input_items(
        self, response_id: str, caller: Caller, page: ItemsPage
    ) -> dict[str, Any]:
        """A page of the response's input items (``GET /v1/responses/{id}/input_items``),
        each with an ``id`` (an item sent without one gets ``msg_`` ... of its place)."""
        record = await self._sessions.record(self._lookup(response_id, caller))
        items = _as_items(json.loads(raw_body(record)).get("input")) or []
        listed = [_listed(item, record.request_id, index) for index, item in enumerate(items)]
        return page.of(listed)

    def _lookup(self, response_id: str, caller: Caller) -> Lookup:
        """The response `response_id` names, asked for by `caller` (unknown: a 404)."""
        lookup = Lookup(request_id_of(response_id) or "", KINDS, caller, response_id)
        if not lookup.request_id:
            raise lookup.not_found()
        return lookup

    async def _parse(self, raw: bytes) -> Parsed:
        body = await self._parser.run(parse_responses_body, len(raw), raw, self._limits)
        return Parsed(body, body.params)


def _writer(session: Session) -> ResponseWriter:
    assert isinstance(session.body, ResponsesBody) and session.record is not None
    return writer_of(session.prepared, session.body, session.record)


PREVIOUS = "previous_response_id"
_INPUT_INDEX = re.compile(r"input(\[|\.)(\d+)")


def as_sent(error: PdserveError, num_earlier: int) -> PdserveError:
    """`error` about a continued request's input as its client sent it: an item of its own
    input named by its place there (``input[i]``, ``input.i``), one of the earlier
    conversation as ``previous_response_id``."""
    param = error.metadata.get("param", "")
    places = [int(found.group(2)) for found in _INPUT_INDEX.finditer(param + error.message)]
    if not num_earlier or not places or error.reason is not ErrorReason.INVALID_REQUEST:
        return error
    if min(places) < num_earlier:
        return invalid(
            f"the conversation of previous_response_id is refused: {error.message}", PREVIOUS
        )

    def own(found: re.Match[str]) -> str:
        return f"input{found.group(1)}{int(found.group(2)) - num_earlier}"

    return invalid(_INPUT_INDEX.sub(own, error.message), _INPUT_INDEX.sub(own, param))


def _as_items(value: object) -> list[Any] | None:
    """A body's ``input`` as a list of items (a string is one user message); None for what
    the parser refuses."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return value if isinstance(value, list) else None


def _listed(item: Any, request_id: str, index: int) -> dict[str, Any]:
    """An input item as ``input_items`` lists it: with its ``id`` and ``type``, a message's
    string content as one text part, a message's status ``completed`` where it has none."""
    listed = dict(item)
    kind = listed.setdefault("type", "message")
    listed.setdefault("id", f"msg_{request_id}_in{index}")
    if kind == "message":
        content = listed.get("content")
        if isinstance(content, str):
            part = "output_text" if listed.get("role") == "assistant" else "input_text"
            text_part: dict[str, Any] = {"type": part, "text": content}
            if part == "output_text":
                text_part["annotations"] = []
            listed["content"] = [text_part]
        listed.setdefault("status", "completed")
    return listed


@dataclass(frozen=True)
class ItemsPage:
    """Which input items a list asks for (OpenAI's list parameters).

    Attributes:
        limit: Most items (1 to 100).
        order: ``asc`` (as given) or ``desc`` (the last first: the default).
        after: List the items after this id (in `order`); None: from the first.
    """

    limit: int = 20
    order: str = "desc"
    after: str | None = None

    @classmethod
    def of_query(cls, query: Mapping[str, str]) -> ItemsPage:
        """The page a query string asks for.

        Raises:
            PdserveError: INVALID_REQUEST naming the parameter.
        """
        raw_limit = query.get("limit", "20")
        if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= MAX_ITEMS_PAGE:
            raise invalid(f"limit must be an integer from 1 to {MAX_ITEMS_PAGE}", "limit")
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise invalid("order must be 'asc' or 'desc'", "order")
        return cls(int(raw_limit), order, query.get("after"))

    def of(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        """The page of `items` (OpenAI's list object)."""
        ordered = items if self.order == "asc" else items[::-1]
        start = 0
        if self.after is not None:
            ids = [item["id"] for item in ordered]
            if self.after not in ids:
                raise invalid(f"no input item with id {self.after[:200]!r}", "after")
            start = ids.index(self.after) + 1
        data = ordered[start : start + self.limit]
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": start + self.limit < len(ordered),
        }


MAX_ITEMS_PAGE = 100
