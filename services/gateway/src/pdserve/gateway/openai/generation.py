"""One generation request over REST, whichever endpoint it came to: parse and prepare the body,
admit it, open its session (`pdserve.gateway.session`: plain, or a background response or a
resumable stream), and answer it as one JSON body or as server-sent events.

A streaming request is answered only once its first token exists, so errors before it (no
capacity, bad prompt) still get their own HTTP status rather than a 200 with an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable
from typing import Any, NamedTuple, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace

from pdserve.common import telemetry
from pdserve.common.errors import PdserveError
from pdserve.gateway.access.admission import Admission
from pdserve.gateway.access.auth import Caller
from pdserve.gateway.openai.http import error_response, request_id_of
from pdserve.gateway.openai.parsing import OpenAIBody, parse_openai_body
from pdserve.gateway.openai.responses import Responder
from pdserve.gateway.openai.responses_api.convert import ResponsesBody, parse_responses_body
from pdserve.gateway.openai.responses_api.stored import as_sent
from pdserve.gateway.openai.responses_api.writer import ResponseWriter
from pdserve.gateway.openai.rest_context import RestContext
from pdserve.gateway.openai.resumable import events as resumable_events
from pdserve.gateway.openai.resumable import responder_for
from pdserve.gateway.openai.sse import EventStreamResponse
from pdserve.gateway.prepare.params import PreparedRequest
from pdserve.gateway.prepare.validation import invalid
from pdserve.gateway.request import ApiKind, OutputDelta
from pdserve.gateway.session.session import Session, SessionMode

T = TypeVar("T")


class Writer(Protocol):
    """Shapes a plain request's deltas as its endpoint's body or events (`Responder`,
    `ResponseWriter`)."""

    def full(self, deltas: list[tuple[int, OutputDelta]]) -> dict[str, Any]: ...

    def events(
        self,
        first: tuple[int, OutputDelta],
        deltas: AsyncGenerator[tuple[int, OutputDelta], None],
    ) -> AsyncGenerator[str, None]: ...


class Prepared(NamedTuple):
    """A generation request parsed and prepared, in the gateway's terms.

    Attributes:
        writer: Its writer (of a plain request).
        prompts: Its prepared requests.
        is_stream: It is answered as server-sent events.
        mode: How it runs (a background response, a resumable stream, or plain).
        raw: The body as sent.
        body: The body as parsed.
    """

    writer: Writer
    prompts: list[PreparedRequest]
    is_stream: bool
    mode: SessionMode
    raw: bytes
    body: ResponsesBody | OpenAIBody


async def generate(context: RestContext, request: Request, kind: ApiKind) -> Response:
    """Answers one generation request (the API key, admission, then the body)."""
    caller = context.authorize(request)
    if caller.api_key_name is not None:
        # NOTE: the current span is FastAPI's HTTP server span (gateway.request has it too).
        trace.get_current_span().set_attribute(telemetry.API_KEY_NAME, caller.api_key_name)
    admission = context.limiter.admit(caller)
    response: Response | None = None
    try:
        response = await _generate(context, request, kind, admission, caller)
        return response
    finally:
        # NOTE: a stream gives its admission back when it ends (EventStreamResponse).
        if not isinstance(response, EventStreamResponse):
            admission.release()


async def _prepare(
    context: RestContext, request: Request, kind: ApiKind, caller: Caller
) -> Prepared:
    """The body parsed (`ApiKind` says which endpoint's) and prepared."""
    raw = await context.json_body(request)
    frontend, parser = context.frontend, context.parser
    limits = frontend.limits
    request_id = request_id_of(request)
    can_keep = context.sessions.can_keep
    if kind is ApiKind.RESPONSES:
        stored = context.stored
        num_earlier = 0
        if stored is not None and b"previous_response_id" in raw:
            raw, num_earlier = await stored.continued(raw, caller)
        parsed = await _parse_responses(context, raw, num_earlier)
        if stored is not None and parsed.previous_response_id is not None and not num_earlier:
            # NOTE: the key written with escapes (the byte test above missed it).
            raw, num_earlier = await stored.continued(raw, caller)
            parsed = await _parse_responses(context, raw, num_earlier)
        if stored is None:
            if parsed.background:
                raise invalid("background responses are not enabled on this gateway", "background")
            if parsed.previous_response_id is not None:
                raise invalid("this gateway stores no responses", "previous_response_id")
            parsed = parsed._replace(store=False)
        prompt = await frontend.prepare(parsed.params, request_id, caller.api_key_name)
        mode = (
            SessionMode.BACKGROUND
            if parsed.background
            else SessionMode.STORED
            if parsed.store
            else SessionMode.PLAIN
        )
        writer = ResponseWriter(prompt, parsed)
        return Prepared(writer, [prompt], parsed.stream, mode, raw, parsed)
    body = await parser.run(parse_openai_body, len(raw), raw, kind, limits)
    prompts = [
        await frontend.prepare(
            params, request_id if index == 0 else f"{request_id}-p{index}", caller.api_key_name
        )
        for index, params in enumerate(body.params)
    ]
    if body.resumable and not can_keep:
        raise invalid("resumable streams are not enabled", "stream_options.resumable")
    mode = SessionMode.RESUMABLE if body.resumable else SessionMode.PLAIN
    return Prepared(Responder(kind, prompts, body), prompts, body.stream, mode, raw, body)


async def _parse_responses(context: RestContext, raw: bytes, num_earlier: int) -> ResponsesBody:
    """A Responses body parsed; an error about its input names the items as its client sent
    them (`num_earlier` put before them by a continuation: `as_sent`)."""
    limits = context.frontend.limits
    try:
        return await context.parser.run(parse_responses_body, len(raw), raw, limits)
    except PdserveError as error:
        raise as_sent(error, num_earlier) from None


async def _generate(
    context: RestContext,
    request: Request,
    kind: ApiKind,
    admission: Admission,
    caller: Caller,
) -> Response:
    prepared = await _prepare(context, request, kind, caller)
    request_id = prepared.prompts[0].request_id
    # NOTE: the current span is FastAPI's HTTP server span; gateway.request becomes its child.
    trace.get_current_span().set_attribute(telemetry.REQUEST_ID, request_id)
    headers = {"X-Request-Id": request_id}
    session = await context.sessions.open(
        kind, prepared.prompts, caller, prepared.mode, prepared.raw, prepared.body
    )
    if prepared.mode.is_kept:
        return _follow_kept(context, session, prepared, headers, admission)
    writer = prepared.writer
    if prepared.mode is SessionMode.STORED:
        # NOTE: its times are its record's, so any gateway reading it back says the same.
        assert isinstance(prepared.body, ResponsesBody) and session.created_at is not None
        writer = ResponseWriter(
            session.prepared, prepared.body, session.clock, created_at=session.created_at
        )
    deltas = session.deltas()
    if prepared.is_stream:
        # NOTE: the status waits for the first token (a request that cannot be served is
        # a 429 or 503, not an SSE error), which may wait in the admission queue: a
        # client that goes away meanwhile leaves the queue at once.
        try:
            first = await _first_unless_disconnected(request, deltas)
        except PdserveError as error:
            await deltas.aclose()
            return error_response(error)
        if first is None:
            await deltas.aclose()
            return Response(status_code=499)
        return EventStreamResponse(writer.events(first, deltas), headers, admission)
    collected = await _collect_unless_disconnected(request, deltas)
    if collected is None:
        return Response(status_code=499)
    return JSONResponse(writer.full(collected), headers=headers)


def _follow_kept(
    context: RestContext,
    session: Session,
    prepared: Prepared,
    headers: dict[str, str],
    admission: Admission,
) -> Response:
    """The answer to a background response or a resumable stream just started; the client
    only follows it (leaving does not stop it)."""
    if isinstance(prepared.body, ResponsesBody):
        stored = context.stored
        assert stored is not None
        if prepared.is_stream:
            return EventStreamResponse(stored.events(session), headers, admission)
        return JSONResponse(stored.queued(session), headers=headers)
    responder = responder_for(session.kind, session, prepared.body)
    return EventStreamResponse(resumable_events(responder, session, None), headers, admission)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _first_unless_disconnected(
    request: Request, deltas: AsyncGenerator[tuple[int, OutputDelta], None]
) -> tuple[int, OutputDelta] | None:
    """The first delta of a streamed request, or None if the client went away first."""
    return await _unless_disconnected(request, anext(deltas))


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None (`work` cancelled) if the client went away first."""
    working = asyncio.ensure_future(work)
    disconnect = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({working, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        if not working.done():
            working.cancel()
            await asyncio.gather(working, return_exceptions=True)
    if working.cancelled():
        return None
    return working.result()


async def _collect_unless_disconnected(
    request: Request, deltas: AsyncGenerator[tuple[int, OutputDelta], None]
) -> list[tuple[int, OutputDelta]] | None:
    """All deltas of a non-streamed request, or None if the client went away first."""

    async def collect() -> list[tuple[int, OutputDelta]]:
        async with contextlib.aclosing(deltas):
            return [delta async for delta in deltas]

    return await _unless_disconnected(request, collect())
