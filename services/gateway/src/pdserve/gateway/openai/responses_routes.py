"""The Responses API's routes: ``POST /v1/responses`` (on the chat path, its events typed; see
`pdserve.gateway.openai.responses_api`), and for stored and background responses ``GET`` and
``DELETE`` ``/v1/responses/{id}`` (``?stream=true&starting_after=N``), ``GET
.../input_items`` and ``POST .../cancel`` (`pdserve.gateway.openai.responses_api.stored`);
other ``/v1/responses/...`` paths are 404s."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.gateway.openai.generation import generate
from pdserve.gateway.openai.responses_api.stored import ItemsPage, StoredResponses
from pdserve.gateway.openai.rest_context import RestContext
from pdserve.gateway.openai.resumable import position_of
from pdserve.gateway.openai.sse import EventStreamResponse
from pdserve.gateway.request import ApiKind

NOT_STORED = (
    "not found: this gateway stores no responses; a stored response is read at "
    "/v1/responses/{id}[/input_items], cancelled or deleted at /v1/responses/{id}[/cancel]"
)


def responses_routes(context: RestContext) -> APIRouter:
    """The Responses API's routes over `context`."""
    router = APIRouter()

    def stored() -> StoredResponses:
        if context.stored is None:
            raise StarletteHTTPException(404, NOT_STORED)
        return context.stored

    @router.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await generate(context, request, ApiKind.RESPONSES)

    @router.get("/v1/responses/{response_id}")
    async def retrieve_response(request: Request, response_id: str) -> Response:
        caller = context.authorize(request)
        background = stored()
        query = request.query_params
        if query.get("stream", "false").lower() not in ("true", "1"):
            return JSONResponse(await background.retrieve(response_id, caller))
        starting_after = position_of((query.get("starting_after"),))
        events = await background.stream(response_id, caller, starting_after)
        admission = context.limiter.admit(caller)
        return EventStreamResponse(events, {"X-Request-Id": response_id}, admission)

    @router.get("/v1/responses/{response_id}/input_items")
    async def input_items(request: Request, response_id: str) -> Response:
        caller = context.authorize(request)
        page = ItemsPage.of_query(request.query_params)
        return JSONResponse(await stored().input_items(response_id, caller, page))

    @router.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(request: Request, response_id: str) -> Response:
        caller = context.authorize(request)
        return JSONResponse(await stored().cancel(response_id, caller))

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> Response:
        caller = context.authorize(request)
        return JSONResponse(await stored().delete(response_id, caller))

    @router.api_route("/v1/responses/{path:path}", methods=["GET", "POST", "DELETE"])
    async def stored_responses(request: Request) -> Response:
        context.authorize(request)
        raise StarletteHTTPException(404, NOT_STORED)

    return router
