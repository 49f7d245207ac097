"""The OpenAI-compatible REST API (FastAPI).

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (both
streaming as server-sent events ending in ``data: [DONE]``, or a single JSON body),
``GET /health`` (readiness: 503 with a reason until a compatible prefill/decode pair serves
some model, or while draining), ``GET /livez`` (liveness) and ``GET /metrics``. Errors are
OpenAI error bodies
``{"error": {"message", "type", "param", "code"}}`` with the HTTP status of their reason
(``code`` is the lower-case pdserve.v1 reason) and ``Retry-After`` where a delay helps (see
`pdserve.gateway.openai_http`). Paths are exact: a trailing slash is a 404, not a redirect.

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
import json
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.telemetry import TelemetryConfig
from opentelemetry import trace
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from pdserve.common import telemetry
from pdserve.common.errors import PdserveError
from pdserve.gateway.admission import Admission, ConcurrencyLimiter
from pdserve.gateway.auth import bearer_token, check_bearer
from pdserve.gateway.frontend import Frontend
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.openai_http import (
    RequestIdMiddleware,
    check_json_content_type,
    error_body,
    error_response,
    http_error_response,
    read_body,
    request_id_of,
)
from pdserve.gateway.params import OutputDelta, PreparedRequest
from pdserve.gateway.parsing import OpenAIBody, parse_openai_body
from pdserve.gateway.workers import ParserPool

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
TRACED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


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


NOT_READY_REASON = "no compatible prefill/decode pair is registered for any model yet"


def _sse(data: dict[str, Any] | str) -> str:
    payload = (
        data
        if isinstance(data, str)
        else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    )
    return f"data: {payload}\n\n"


def _usage(delta: OutputDelta) -> dict[str, Any] | None:
    if delta.usage is None:
        return None
    usage: dict[str, Any] = {
        "prompt_tokens": delta.usage.num_prompt_tokens,
        "completion_tokens": delta.usage.num_completion_tokens,
        "total_tokens": delta.usage.num_total_tokens,
    }
    if delta.usage.num_cached_prompt_tokens:
        usage["prompt_tokens_details"] = {"cached_tokens": delta.usage.num_cached_prompt_tokens}
    return usage


class _EventStreamResponse(StreamingResponse):
    """An SSE response that always closes its event generator and gives back its admission,
    even on client disconnect."""

    def __init__(
        self, events: AsyncGenerator[str, None], headers: dict[str, str], admission: Admission
    ) -> None:
        super().__init__(events, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
        self._events = events
        self._admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._admission.release()
            await self._events.aclose()


class _Responder:
    """Shapes one request's deltas as a completion or chat completion (stream or not)."""

    def __init__(self, is_chat: bool, prepared: PreparedRequest, body: OpenAIBody) -> None:
        self.is_chat = is_chat
        self.prepared = prepared
        self.model = body.model
        self.return_token_ids = body.return_token_ids
        self.include_usage = body.include_usage
        self.response_id = ("chatcmpl-" if is_chat else "cmpl-") + prepared.request_id
        self.created = int(time.time())
        self.object_name = "chat.completion" if is_chat else "text_completion"

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def full(self, deltas: list[OutputDelta]) -> dict[str, Any]:
        """The non-streamed response body."""
        text = "".join(d.text for d in deltas)
        last = deltas[-1]
        choice: dict[str, Any] = {"index": 0, "logprobs": None}
        if self.is_chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["finish_reason"] = last.finish_reason.value if last.finish_reason else None
        if self.return_token_ids:
            choice["prompt_token_ids"] = list(self.prepared.prompt_token_ids)
            choice["token_ids"] = [t for d in deltas for t in d.token_ids]
        body = self._envelope(self.object_name, [choice])
        body["usage"] = _usage(last)
        return body

    def chunk(self, delta: OutputDelta, is_first: bool) -> dict[str, Any] | None:
        """One streamed chunk, or None when the delta carries nothing to send."""
        if not (
            delta.text or delta.token_ids or delta.finish_reason or (is_first and self.is_chat)
        ):
            return None
        choice: dict[str, Any] = {"index": 0}
        if self.is_chat:
            content: dict[str, Any] = {"role": "assistant"} if is_first else {}
            if delta.text or is_first:
                content["content"] = delta.text
            choice["delta"] = content
        else:
            choice["text"] = delta.text
        choice["logprobs"] = None
        choice["finish_reason"] = delta.finish_reason.value if delta.finish_reason else None
        if self.return_token_ids:
            if is_first:
                choice["prompt_token_ids"] = list(self.prepared.prompt_token_ids)
            choice["token_ids"] = list(delta.token_ids)
        body = self._envelope(self.object_name + (".chunk" if self.is_chat else ""), [choice])
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, delta: OutputDelta) -> dict[str, Any]:
        """The final chunk of ``stream_options.include_usage``: no choices, the usage."""
        body = self._envelope(self.object_name + (".chunk" if self.is_chat else ""), [])
        body["usage"] = _usage(delta)
        return body

    def render(self, delta: OutputDelta, is_first: bool) -> list[str]:
        """The SSE events of one delta (none when it carries nothing)."""
        events = []
        chunk = self.chunk(delta, is_first)
        if chunk is not None:
            events.append(_sse(chunk))
        if delta.finish_reason is not None and self.include_usage:
            events.append(_sse(self.usage_chunk(delta)))
        return events

    async def events(
        self, first: OutputDelta, deltas: AsyncGenerator[OutputDelta, None]
    ) -> AsyncGenerator[str, None]:
        """The SSE events of a stream whose first delta was already received."""
        try:
            rendered = self.render(first, is_first=True)
            is_first = not rendered
            for event in rendered:
                yield event
            async for delta in deltas:
                rendered = self.render(delta, is_first)
                is_first = is_first and not rendered
                for event in rendered:
                    yield event
        except PdserveError as error:
            # NOTE: the headers are sent already; report the error in-band, as vLLM does.
            message = error.message or error.reason.name
            yield _sse(error_body(message, error.http_status, error.reason.name.lower()))
        finally:
            await deltas.aclose()
        yield _sse("[DONE]")


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def create_app(
    frontend: Frontend,
    metrics: GatewayMetrics,
    *,
    limiter: ConcurrencyLimiter,
    parser: ParserPool,
    max_body_bytes: int,
    api_key: str | None = None,
    trace_polls: bool = False,
    now: Callable[[], float] = time.time,
) -> FastAPI:
    """Builds the REST application around a `Frontend`.

    Args:
        frontend: Validation, tokenization and streaming (and the request limits).
        metrics: Served at /metrics.
        limiter: Admission of generation requests (per API key and in total).
        parser: Parses large bodies in worker processes.
        max_body_bytes: Largest request body; larger ones are refused with 413.
        api_key: Required as a Bearer token on /v1/* when set.
        trace_polls: Trace /health, readiness, /v1/models and /metrics requests too.
        now: Wall clock for ``created`` timestamps.
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
            "num_active_requests": frontend.num_active_requests,
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

    def authorize(request: Request) -> None:
        check_bearer(request.headers.get("authorization"), api_key)

    async def generate(request: Request, is_chat: bool) -> Response:
        authorization = request.headers.get("authorization")
        check_bearer(authorization, api_key)
        admission = limiter.admit(bearer_token(authorization))
        response: Response | None = None
        try:
            response = await _generate(request, is_chat, admission)
            return response
        finally:
            # NOTE: a stream gives its admission back when it ends (_EventStreamResponse).
            if not isinstance(response, _EventStreamResponse):
                admission.release()

    async def _generate(request: Request, is_chat: bool, admission: Admission) -> Response:
        check_json_content_type(request)
        raw = await read_body(request, max_body_bytes)
        body = await parser.run(parse_openai_body, len(raw), raw, is_chat, frontend.limits)
        prepared = await frontend.prepare(body.params, request_id_of(request))
        # NOTE: the current span is FastAPI's HTTP server span; gateway.request becomes its child.
        trace.get_current_span().set_attribute(telemetry.REQUEST_ID, prepared.request_id)
        responder = _Responder(is_chat, prepared, body)
        headers = {"X-Request-Id": prepared.request_id}
        deltas = frontend.stream(prepared)
        if body.stream:
            try:
                first = await anext(deltas)
            except PdserveError as error:
                await deltas.aclose()
                return error_response(error)
            return _EventStreamResponse(responder.events(first, deltas), headers, admission)
        collected = await _collect_unless_disconnected(request, deltas)
        if collected is None:
            return Response(status_code=499)
        return JSONResponse(responder.full(collected), headers=headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, is_chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, is_chat=True)

    return app


async def _collect_unless_disconnected(
    request: Request, deltas: AsyncGenerator[OutputDelta, None]
) -> list[OutputDelta] | None:
    """All deltas of a non-streamed request, or None if the client went away first."""

    async def collect() -> list[OutputDelta]:
        async with contextlib.aclosing(deltas):
            return [delta async for delta in deltas]

    collecting = asyncio.ensure_future(collect())
    disconnect = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({collecting, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        if not collecting.done():
            collecting.cancel()
            await asyncio.gather(collecting, return_exceptions=True)
    if collecting.cancelled():
        return None
    return collecting.result()
