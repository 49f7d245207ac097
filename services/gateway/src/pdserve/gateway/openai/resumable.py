"""Resumable chat and completions streams (``stream_options: {"resumable": true}``).

Such a stream is a resumable session (`pdserve.gateway.session`): a
client that goes away only stops following it, and a gateway that dies leaves it running on
its decode. Every server-sent event carries ``id: N``, N being the completion tokens sent so
far (its own included). A client resumes on any gateway sharing the store with

    GET /v1/chat/completions/{id}/stream?starting_after=N   (or /v1/completions/...)

(``{id}`` is the ``X-Request-Id`` header, or the chunks' ``id`` with its ``chatcmpl-`` /
``cmpl-`` prefix; a ``Last-Event-ID: N`` header does as ``starting_after``), and gets every
event holding tokens after the N-th, then the end: the same chunks, token for token and text
for text, as the stream it left. Without ``starting_after`` it gets the whole stream again; past
the end, the end. Only the key that created a stream may resume it; to others it does not
exist (404).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Sequence

from pdserve.common.errors import PdserveError
from pdserve.gateway.access.auth import Caller
from pdserve.gateway.openai.http import error_body
from pdserve.gateway.openai.parsing import OpenAIBody, parse_openai_body
from pdserve.gateway.openai.responses import Responder
from pdserve.gateway.openai.rest_context import RestContext
from pdserve.gateway.openai.sse import sse
from pdserve.gateway.prepare.validation import invalid
from pdserve.gateway.request import ApiKind
from pdserve.gateway.session.access import Lookup
from pdserve.gateway.session.run import RunMoved
from pdserve.gateway.session.session import Parsed, Session
from pdserve.gateway.session.sessions import ParseStored

PREFIXES = ("chatcmpl-", "cmpl-")


async def resume(
    context: RestContext, stream_id: str, kind: ApiKind, caller: Caller, starting_after: int | None
) -> AsyncGenerator[str, None]:
    """The events of a stream after its `starting_after`-th token (all: None), live; a
    running stream another gateway held is taken over.

    Raises:
        PdserveError: REQUEST_NOT_FOUND (404) for an unknown, expired or other key's
            stream.
    """
    request_id = stream_id
    for prefix in PREFIXES:
        request_id = request_id.removeprefix(prefix)
    parse = stored_parser(context, kind)
    session = await context.sessions.resume(Lookup(request_id, (kind,), caller, stream_id), parse)
    assert isinstance(session.body, OpenAIBody)
    return events(responder_for(kind, session, session.body), session, starting_after)


def stored_parser(context: RestContext, kind: ApiKind) -> ParseStored:
    """Parses a stored chat or completions body again (in a worker process when large)."""

    async def parse(raw: bytes) -> Parsed:
        limits = context.frontend.limits
        body = await context.parser.run(parse_openai_body, len(raw), raw, kind, limits)
        return Parsed(body, body.params[0])

    return parse


def responder_for(kind: ApiKind, session: Session, body: OpenAIBody) -> Responder:
    """The responder of a resumable stream (``created`` from its record)."""
    responder = Responder(kind, session.prompts, body)
    if session.created_at is not None:
        responder.created = int(session.created_at)
    return responder


async def events(
    responder: Responder, session: Session, starting_after: int | None
) -> AsyncGenerator[str, None]:
    """The SSE events of a resumable stream, each with ``id: <tokens sent>``, after its
    `starting_after`-th token (every delta is rendered, since a chunk depends on the ones
    before it; only those the session marks as after are sent); ends quietly where another
    gateway took the stream over."""
    position = 0
    is_first = True
    steps = session.steps(starting_after)
    async with contextlib.aclosing(steps):
        try:
            async for step in steps:
                position = step.position
                rendered = responder.render(step.choice_index, step.delta, is_first)
                if rendered:
                    is_first = False
                if step.is_after:
                    for event in rendered:
                        yield f"id: {position}\n{event}"
        except RunMoved:
            return
        except PdserveError as error:
            message = error.message or error.reason.name
            yield sse(error_body(message, error.http_status, error.reason.name.lower()))
    yield f"id: {position}\n" + sse("[DONE]")


def position_of(values: Sequence[str | None]) -> int | None:
    """The first of `values` given (e.g. ``starting_after``, then ``Last-Event-ID``) as a
    non-negative integer (a token count or a sequence number); None when none is.

    Raises:
        PdserveError: INVALID_REQUEST (``starting_after``) for anything else.
    """
    for value in values:
        if value is None:
            continue
        try:
            number = int(value)
        except ValueError:
            number = -1
        if number < 0:
            raise invalid("starting_after must be a non-negative integer", "starting_after")
        return number
    return None
