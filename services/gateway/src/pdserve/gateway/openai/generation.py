"""One generation request over REST, whichever endpoint it came to: parse and prepare the body,
admit it, run it (or start it as a background response or a resumable stream), and answer it as
one JSON body or as server-sent events.

A streaming request is answered only once its first token exists, so errors before it (no
capacity, bad prompt) still get their own HTTP status rather than a 200 with an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace

from pdserve.common import telemetry
from pdserve.common.errors import PdserveError
from pdserve.gateway.access.admission import Admission
from pdserve.gateway.access.auth import Caller
from pdserve.gateway.choices import merged
from pdserve.gateway.openai.http import error_response, request_id_of
from pdserve.gateway.openai.parsing import OpenAIBody, parse_openai_body
from pdserve.gateway.openai.responses import Responder
from pdserve.gateway.openai.responses_api.convert import ResponsesBody, parse_responses_body
from pdserve.gateway.openai.responses_api.writer import ResponseWriter
from pdserve.gateway.openai.rest_context import RestContext
from pdserve.gateway.openai.resumable import events as resumable_events
from pdserve.gateway.openai.resumable import responder_for
from pdserve.gateway.openai.sse import EventStreamResponse
from pdserve.gateway.prepare.params import PreparedRequest
from pdserve.gateway.prepare.validation import invalid
from pdserve.gateway.request import ApiKind, OutputDelta

T = TypeVar("T")


class Writer(Protocol):
    """Shapes a request's deltas as its endpoint's body or events (`Responder`,
    `ResponseWriter`)."""

    @property
    def choices(self) -> Sequence[PreparedRequest]: ...

    @property
    def n(self) -> int: ...

    def full(self, deltas: list[tuple[int, OutputDelta]]) -> dict[str, Any]: ...

    def events(
        self,
        first: tuple[int, OutputDelta],
        deltas: AsyncGenerator[tuple[int, OutputDelta], None],
    ) -> AsyncGenerator[str, None]: ...


class Prepared(NamedTuple):
    """A generation request parsed and prepared: its writer, whether it streams, its id (and
    for a background response or a resumable stream, its body as sent and as parsed)."""

    writer: Writer
    is_stream: bool
    request_id: str
    kept: tuple[bytes, ResponsesBody | OpenAIBody] | None = None


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
    raw = await context.json_body(request)
    frontend, parser = context.frontend, context.parser
    limits = frontend.limits
    request_id = request_id_of(request)
    if kind == ApiKind.RESPONSES:
        parsed = await parser.run(parse_responses_body, len(raw), raw, limits)
        if parsed.background and context.background is None:
            raise invalid("background responses are not enabled on this gateway", "background")
        prompt = await frontend.prepare(parsed.params, request_id, caller.api_key_name)
        background_kept = (raw, parsed) if parsed.background else None
        return Prepared(
            ResponseWriter(prompt, parsed), parsed.stream, prompt.request_id, background_kept
        )
    body = await parser.run(parse_openai_body, len(raw), raw, kind == ApiKind.CHAT, limits)
    prompts = [
        await frontend.prepare(
            params, request_id if index == 0 else f"{request_id}-p{index}", caller.api_key_name
        )
        for index, params in enumerate(body.params)
    ]
    if body.resumable and context.resumable is None:
        raise invalid("resumable streams are not enabled", "stream_options.resumable")
    kept = (raw, body) if body.resumable else None
    writer = Responder(kind, prompts, body)
    return Prepared(writer, body.stream, prompts[0].request_id, kept)


async def _generate(
    context: RestContext,
    request: Request,
    kind: ApiKind,
    admission: Admission,
    caller: Caller,
) -> Response:
    writer, is_stream, request_id, kept = await _prepare(context, request, kind, caller)
    # NOTE: the current span is FastAPI's HTTP server span; gateway.request becomes its child.
    trace.get_current_span().set_attribute(telemetry.REQUEST_ID, request_id)
    headers = {"X-Request-Id": request_id}
    if kept is not None:
        return await _start_kept(context, kept, kind, writer, is_stream, headers, admission, caller)
    deltas = merged([context.streamer.stream(c) for c in writer.choices], writer.n)
    if is_stream:
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


async def _start_kept(
    context: RestContext,
    kept: tuple[bytes, ResponsesBody | OpenAIBody],
    kind: ApiKind,
    writer: Writer,
    is_stream: bool,
    headers: dict[str, str],
    admission: Admission,
    caller: Caller,
) -> Response:
    """Starts a background response or a resumable stream; the client only follows it
    (leaving does not stop it)."""
    raw, parsed = kept
    prompt = writer.choices[0]
    if isinstance(parsed, ResponsesBody):
        background = context.background
        assert background is not None
        run = await background.create(raw, parsed, prompt, caller)
        if is_stream:
            return EventStreamResponse(background.events(run, parsed), headers, admission)
        return JSONResponse(background.queued(run, parsed), headers=headers)
    assert context.resumable is not None
    stream = await context.resumable.start(raw, kind, prompt, caller)
    events = resumable_events(responder_for(kind, prompt, parsed, stream), stream.follow(), None)
    return EventStreamResponse(events, headers, admission)


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
