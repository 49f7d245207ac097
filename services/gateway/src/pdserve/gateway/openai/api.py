"""The OpenAI-compatible REST API (FastAPI): the application, its error handlers and its route
families.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (both
streaming as server-sent events ending in ``data: [DONE]``, or a single JSON body),
``POST /v1/responses`` (the Responses API on the chat path, its events typed; see
`pdserve.gateway.openai.responses_api`), and for stored and background responses ``GET``,
``DELETE`` ``/v1/responses/{id}`` (``?stream=true&starting_after=N``), ``GET
.../input_items`` and ``POST .../cancel`` (`pdserve.gateway.openai.responses_api.stored`;
other ``/v1/responses/...`` paths are 404s),
``POST /tokenize`` and ``POST /detokenize`` (as vLLM's),
``GET /health`` (readiness: 503 with a reason until a compatible prefill/decode pair serves
some model, or while draining), ``GET /livez`` (liveness) and ``GET /metrics``. Errors are
OpenAI error bodies
``{"error": {"message", "type", "param", "code"}}`` with the HTTP status of their reason
(``code`` is the lower-case pdserve.v1 reason) and ``Retry-After`` where a delay helps (see
`pdserve.gateway.openai.http`); bodies and SSE events are shaped in
`pdserve.gateway.openai.responses`. Paths are exact: a trailing slash is a 404, not a redirect.
The routes come in three families, each in a module of its own: chat and completions
(`chat_routes`), the Responses API (`responses_routes`), and health, metrics, models and the
tokenizer (`service_routes`); the generation path they share is `generation`.

A generation request passes, in order: the API key (401), admission (429, per key and in
total), ``Content-Type: application/json`` (415), the body size (413, before the body is read
where ``Content-Length`` tells), parsing and validation (400; large bodies parse in a worker
process), then the `Frontend`.

Tracing: FastAPI's own OpenTelemetry support makes the HTTP SERVER span of each request
(``POST /v1/chat/completions``, parented on an incoming ``traceparent``), and the request's
``gateway.request`` span is its child, so one request is one trace. Only the generation
endpoints are traced unless ``trace_polls`` is set; FastAPI's operation spans, metrics and logs
are off (pdserve has its own spans and Prometheus metrics).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.telemetry import TelemetryConfig
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.common.errors import PdserveError
from pdserve.gateway.access.admission import ConcurrencyLimiter
from pdserve.gateway.access.api_keys import ApiKeyStore
from pdserve.gateway.frontend import Frontend
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.openai.chat_routes import chat_routes
from pdserve.gateway.openai.http import RequestIdMiddleware, error_response, http_error_response
from pdserve.gateway.openai.responses_api.stored import StoredResponses
from pdserve.gateway.openai.responses_routes import responses_routes
from pdserve.gateway.openai.rest_context import RestContext
from pdserve.gateway.openai.resumable import stored_parser
from pdserve.gateway.openai.service_routes import service_routes
from pdserve.gateway.prepare.workers import ParserPool
from pdserve.gateway.request import ApiKind
from pdserve.gateway.session.sessions import Sessions
from pdserve.gateway.streaming import Streamer

TRACED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})


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
    sessions: Sessions | None = None,
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
        sessions: Opens every request; one that can keep requests serves stored and
            background responses (``store``, ``previous_response_id``, ``background: true``,
            ``GET``, ``cancel``, ``DELETE`` on ``/v1/responses/{id}``) and resumable chat and
            completions streams
            (``stream_options.resumable``). None: plain requests only (the others are
            refused with 400, their routes are 404s).
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
    sessions = sessions or Sessions(streamer, frontend)
    stored = StoredResponses(sessions, parser, frontend.limits) if sessions.can_keep else None
    context = RestContext(
        frontend,
        streamer,
        sessions,
        metrics,
        limiter,
        parser,
        max_body_bytes,
        api_keys=api_keys or ApiKeyStore(),
        now=now,
        internal_plane=internal_plane,
        stored=stored,
    )

    @app.exception_handler(PdserveError)
    async def _on_error(_: Request, error: PdserveError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        return http_error_response(error)

    for kind in (ApiKind.CHAT, ApiKind.COMPLETIONS):
        sessions.parse_stored_with(kind, stored_parser(context, kind))
    app.include_router(service_routes(context))
    app.include_router(chat_routes(context))
    app.include_router(responses_routes(context))
    return app
