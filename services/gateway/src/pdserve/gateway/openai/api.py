"""The OpenAI-compatible REST API (FastAPI).

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (both
streaming as server-sent events ending in ``data: [DONE]``, or a single JSON body),
``POST /v1/responses`` (the Responses API on the chat path, its events typed; see
`pdserve.gateway.openai.responses_api`), and for background responses ``GET``, ``DELETE``
``/v1/responses/{id}`` (``?stream=true&starting_after=N``) and ``POST .../cancel``
(`pdserve.gateway.openai.responses_api.background`; other ``/v1/responses/...`` paths are
404s),
``POST /tokenize`` and ``POST /detokenize`` (as vLLM's),
``GET /health`` (readiness: 503 with a reason until a compatible prefill/decode pair serves
some model, or while draining), ``GET /livez`` (liveness) and ``GET /metrics``. Errors are
OpenAI error bodies
``{"error": {"message", "type", "param", "code"}}`` with the HTTP status of their reason
(``code`` is the lower-case pdserve.v1 reason) and ``Retry-After`` where a delay helps (see
`pdserve.gateway.openai.http`); bodies and SSE events are shaped in
`pdserve.gateway.openai.responses`. Paths are exact: a trailing slash is a 404, not a redirect.

A generation request passes, in order: the API key (401), admission (429, per key and in
total), ``Content-Type: application/json`` (415), the body size (413, before the body is read
where ``Content-Length`` tells), parsing and validation (400; large bodies parse in a worker
process), then the `Frontend`. A streaming request is answered only once its first token
exists, so errors before it (no capacity, bad prompt) still get their own HTTP status rather
than a 200 with an error event.

Tracing: FastAPI's own OpenTelemetry support makes the HTTP SERVER span of each request
(``POST /v1/chat/completions``, parented on an incoming ``traceparent``), and the request's
``gateway.request`` span is its child, so one request is one trace. Only the generation
endpoints are traced unless ``trace_polls`` is set; FastAPI's operation spans, metrics and logs
are off (pdserve has its own spans and Prometheus metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.telemetry import TelemetryConfig
from opentelemetry import trace
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.common import telemetry
from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.gateway.access.admission import Admission, ConcurrencyLimiter
from pdserve.gateway.access.api_keys import ApiKeyStore
from pdserve.gateway.access.auth import Caller, authenticate
from pdserve.gateway.choices import merged
from pdserve.gateway.frontend import Frontend
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.openai.http import (
    RequestIdMiddleware,
    check_json_content_type,
    error_response,
    http_error_response,
    read_body,
    request_id_of,
)
from pdserve.gateway.openai.parsing import OpenAIBody, parse_openai_body, parse_tokenizer_body
from pdserve.gateway.openai.responses import EventStreamResponse, Responder
from pdserve.gateway.openai.responses_api.background import BackgroundResponses
from pdserve.gateway.openai.responses_api.convert import ResponsesBody, parse_responses_body
from pdserve.gateway.openai.responses_api.writer import ResponseWriter
from pdserve.gateway.openai.resumable import (
    ResumableStreams,
    position_of,
    responder_for,
)
from pdserve.gateway.openai.resumable import events as resumable_events
from pdserve.gateway.openai.schemas import DetokenizeRequest
from pdserve.gateway.prepare.params import GenerationParams, PreparedRequest
from pdserve.gateway.prepare.validation import invalid
from pdserve.gateway.prepare.workers import ParserPool
from pdserve.gateway.request import OutputDelta
from pdserve.gateway.streaming import Streamer

TRACED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})
NOT_STORED = (
    "not found: only background responses are stored (POST /v1/responses with background: "
    "true), and they are retrieved, cancelled or deleted at /v1/responses/{id}[/cancel]"
)


class Endpoint(enum.Enum):
    """The generation endpoints."""

    COMPLETIONS = "completions"
    CHAT = "chat"
    RESPONSES = "responses"


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


def _is_poll(scope: Any) -> bool:
    """Whether FastAPI's tracing skips a request: anything but generation (health, readiness,
    model list, metrics) is a poll."""
    return scope.get("path") not in TRACED_PATHS


def http_telemetry(trace_polls: bool = False) -> TelemetryConfig:
    """FastAPI's OpenTelemetry settings: one HTTP server span per traced request, nothing else.

    The span exists only once tracing is on (`pdserve.common.telemetry.configure_tracing`);
    FastAPI finds no provider before that and adds nothing.

    Args:
        trace_polls: Also trace health, readiness, model-list and metrics requests.
    """
    return {
        "tracing": True,
        "operation_spans": False,
        "metrics": False,
        "logs": False,
        "auto_configure": False,
        "exclude": None if trace_polls else _is_poll,
    }


T = TypeVar("T")

NOT_READY_REASON = "no compatible prefill/decode pair is registered for any model yet"


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def create_app(
    frontend: Frontend,
    streamer: Streamer,
    metrics: GatewayMetrics,
    *,
    limiter: ConcurrencyLimiter,
    parser: ParserPool,
    max_body_bytes: int,
    api_keys: ApiKeyStore | None = None,
    trace_polls: bool = False,
    now: Callable[[], float] = time.time,
    internal_plane: str = "mtls",
    background: BackgroundResponses | None = None,
    resumable: ResumableStreams | None = None,
) -> FastAPI:
    """Builds the REST application around a `Frontend`.

    Args:
        frontend: Validation and tokenization (and the request limits).
        streamer: Runs prepared requests.
        metrics: Served at /metrics.
        limiter: Admission of generation requests (per API key and in total).
        parser: Parses large bodies in worker processes.
        max_body_bytes: Largest request body; larger ones are refused with 413.
        api_keys: Keys accepted as a Bearer token on /v1/*; None or an open store: any.
        trace_polls: Trace /health, readiness, /v1/models and /metrics requests too.
        now: Wall clock for ``created`` timestamps.
        internal_plane: ``mtls`` or ``insecure``, reported by /health.
        background: Background responses (``background: true``, ``GET``, ``cancel``,
            ``DELETE`` on ``/v1/responses/{id}``); None: refused (400) and 404s.
        resumable: Resumable chat and completions streams (``stream_options.resumable``);
            None: refused (400) and 404s.
    """
    app = FastAPI(
        title="pdserve gateway",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        redirect_slashes=False,
        telemetry=http_telemetry(trace_polls),
    )
    app.add_middleware(RequestIdMiddleware)
    keys = api_keys or ApiKeyStore()

    @app.exception_handler(PdserveError)
    async def _on_error(_: Request, error: PdserveError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        return http_error_response(error)

    @app.get("/health")
    async def health() -> JSONResponse:
        # NOTE: readiness: 200 only while some model has a compatible prefill/decode pair.
        models = [m.name for m in frontend.list_models()]
        body: dict[str, Any] = {
            "status": "ok",
            "models": models,
            "num_active_requests": streamer.num_active_requests,
            "internal_plane": internal_plane,
        }
        if frontend.is_draining:
            body.update(status="draining", reason="the gateway is shutting down")
        elif not models:
            body.update(status="not_ready", reason=NOT_READY_REASON)
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    @app.get("/livez")
    async def livez() -> JSONResponse:
        # NOTE: liveness: the process answers; says nothing about backends.
        return JSONResponse({"status": "alive"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        authorize(request)
        created = int(now())
        data = [
            {
                "id": model.name,
                "object": "model",
                "created": created,
                "owned_by": "pdserve",
                "max_model_len": model.max_model_len,
            }
            for model in frontend.list_models()
        ]
        return JSONResponse({"object": "list", "data": data})

    def authorize(request: Request) -> Caller:
        return authenticate(request.headers.get("authorization"), keys)

    async def generate(request: Request, endpoint: Endpoint) -> Response:
        caller = authorize(request)
        if caller.api_key_name is not None:
            # NOTE: the current span is FastAPI's HTTP server span (gateway.request has it too).
            trace.get_current_span().set_attribute(telemetry.API_KEY_NAME, caller.api_key_name)
        admission = limiter.admit(caller)
        response: Response | None = None
        try:
            response = await _generate(request, endpoint, admission, caller)
            return response
        finally:
            # NOTE: a stream gives its admission back when it ends (EventStreamResponse).
            if not isinstance(response, EventStreamResponse):
                admission.release()

    async def _prepare(request: Request, endpoint: Endpoint, caller: Caller) -> Prepared:
        check_json_content_type(request)
        raw = await read_body(request, max_body_bytes)
        limits = frontend.limits
        request_id = request_id_of(request)
        if endpoint is Endpoint.RESPONSES:
            parsed = await parser.run(parse_responses_body, len(raw), raw, limits)
            if parsed.background and background is None:
                raise invalid("background responses are not enabled on this gateway", "background")
            prompt = await frontend.prepare(parsed.params, request_id, caller.api_key_name)
            background_kept = (raw, parsed) if parsed.background else None
            return Prepared(
                ResponseWriter(prompt, parsed), parsed.stream, prompt.request_id, background_kept
            )
        is_chat = endpoint is Endpoint.CHAT
        body = await parser.run(parse_openai_body, len(raw), raw, is_chat, limits)
        prompts = [
            await frontend.prepare(
                params, request_id if index == 0 else f"{request_id}-p{index}", caller.api_key_name
            )
            for index, params in enumerate(body.params)
        ]
        if body.resumable and resumable is None:
            raise invalid("resumable streams are not enabled", "stream_options.resumable")
        kept = (raw, body) if body.resumable else None
        writer = Responder(is_chat, prompts, body)
        return Prepared(writer, body.stream, prompts[0].request_id, kept)

    async def _generate(
        request: Request, endpoint: Endpoint, admission: Admission, caller: Caller
    ) -> Response:
        writer, is_stream, request_id, kept = await _prepare(request, endpoint, caller)
        # NOTE: the current span is FastAPI's HTTP server span; gateway.request becomes its child.
        trace.get_current_span().set_attribute(telemetry.REQUEST_ID, request_id)
        headers = {"X-Request-Id": request_id}
        if kept is not None:
            return await _start_kept(kept, endpoint, writer, is_stream, headers, admission, caller)
        deltas = merged([streamer.stream(c) for c in writer.choices], writer.n)
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
        kept: tuple[bytes, ResponsesBody | OpenAIBody],
        endpoint: Endpoint,
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
            assert background is not None
            run = await background.create(raw, parsed, prompt, caller)
            if is_stream:
                return EventStreamResponse(background.events(run, parsed), headers, admission)
            return JSONResponse(background.queued(run, parsed), headers=headers)
        assert resumable is not None
        is_chat = endpoint is Endpoint.CHAT
        run = await resumable.start(raw, is_chat, prompt, caller)
        events = resumable_events(responder_for(is_chat, prompt, parsed, run), run.follow(), None)
        return EventStreamResponse(events, headers, admission)

    async def _resume(request: Request, stream_id: str, is_chat: bool) -> Response:
        caller = authorize(request)
        if resumable is None:
            raise StarletteHTTPException(404, "resumable streams are not enabled")
        query = request.query_params
        values = (query.get("starting_after"), request.headers.get("last-event-id"))
        events = await resumable.resume(stream_id, is_chat, caller, position_of(values))
        return EventStreamResponse(events, {"X-Request-Id": stream_id}, limiter.admit(caller))

    @app.get("/v1/chat/completions/{stream_id}/stream")
    async def resume_chat_completions(request: Request, stream_id: str) -> Response:
        return await _resume(request, stream_id, is_chat=True)

    @app.get("/v1/completions/{stream_id}/stream")
    async def resume_completions(request: Request, stream_id: str) -> Response:
        return await _resume(request, stream_id, is_chat=False)

    async def tokenizer_body(request: Request) -> GenerationParams | DetokenizeRequest:
        authorize(request)
        check_json_content_type(request)
        raw = await read_body(request, max_body_bytes)
        return await parser.run(parse_tokenizer_body, len(raw), raw, frontend.limits)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        params = await tokenizer_body(request)
        if not isinstance(params, GenerationParams):
            raise PdserveError(ErrorReason.INVALID_REQUEST, "a prompt or messages is required")
        token_ids, max_model_len = await frontend.tokenize(params)
        return JSONResponse(
            {"count": len(token_ids), "max_model_len": max_model_len, "tokens": token_ids}
        )

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        body = await tokenizer_body(request)
        if not isinstance(body, DetokenizeRequest):
            raise PdserveError(ErrorReason.INVALID_REQUEST, "tokens is required")
        return JSONResponse({"prompt": await frontend.detokenize(body.model, body.tokens)})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, Endpoint.COMPLETIONS)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, Endpoint.CHAT)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await generate(request, Endpoint.RESPONSES)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(request: Request, response_id: str) -> Response:
        caller = authorize(request)
        if background is None:
            raise StarletteHTTPException(404, NOT_STORED)
        query = request.query_params
        if query.get("stream", "false").lower() not in ("true", "1"):
            return JSONResponse(await background.retrieve(response_id, caller))
        starting_after = position_of((query.get("starting_after"),))
        events = await background.stream(response_id, caller, starting_after)
        return EventStreamResponse(events, {"X-Request-Id": response_id}, limiter.admit(caller))

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(request: Request, response_id: str) -> Response:
        caller = authorize(request)
        if background is None:
            raise StarletteHTTPException(404, NOT_STORED)
        return JSONResponse(await background.cancel(response_id, caller))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> Response:
        caller = authorize(request)
        if background is None:
            raise StarletteHTTPException(404, NOT_STORED)
        return JSONResponse(await background.delete(response_id, caller))

    @app.api_route("/v1/responses/{path:path}", methods=["GET", "POST", "DELETE"])
    async def stored_responses(request: Request) -> Response:
        authorize(request)
        raise StarletteHTTPException(404, NOT_STORED)

    return app


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
