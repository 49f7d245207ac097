"""The chat and completions routes: ``POST /v1/chat/completions``, ``POST /v1/completions``
(streaming as server-sent events ending in ``data: [DONE]``, or a single JSON body), and
``GET /v1/{chat/,}completions/{id}/stream``, which resumes a resumable stream."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.gateway.openai.generation import generate
from pdserve.gateway.openai.rest_context import RestContext
from pdserve.gateway.openai.resumable import position_of, resume
from pdserve.gateway.openai.sse import EventStreamResponse
from pdserve.gateway.request import ApiKind


def chat_routes(context: RestContext) -> APIRouter:
    """The chat and completions routes over `context`."""
    router = APIRouter()

    async def resume_stream(request: Request, stream_id: str, kind: ApiKind) -> Response:
        caller = context.authorize(request)
        if not context.sessions.can_keep:
            raise StarletteHTTPException(404, "resumable streams are not enabled")
        query = request.query_params
        values = (query.get("starting_after"), request.headers.get("last-event-id"))
        events = await resume(context, stream_id, kind, caller, position_of(values))
        admission = context.limiter.admit(caller)
        return EventStreamResponse(events, {"X-Request-Id": stream_id}, admission)

    @router.get("/v1/chat/completions/{stream_id}/stream")
    async def resume_chat_completions(request: Request, stream_id: str) -> Response:
        return await resume_stream(request, stream_id, ApiKind.CHAT)

    @router.get("/v1/completions/{stream_id}/stream")
    async def resume_completions(request: Request, stream_id: str) -> Response:
        return await resume_stream(request, stream_id, ApiKind.COMPLETIONS)

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(context, request, ApiKind.COMPLETIONS)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(context, request, ApiKind.CHAT)

    return router
