"""The routes around generation: ``GET /health`` (readiness: 503 with a reason until a
compatible prefill/decode pair serves some model, or while draining), ``GET /livez``
(liveness), ``GET /metrics``, ``GET /v1/models`` and ``GET /v1/models/{model}`` (the models
served now), and ``POST /tokenize`` and ``POST /detokenize`` (as vLLM's)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.gateway.openai.parsing import parse_tokenizer_body
from pdserve.gateway.openai.rest_context import RestContext
from pdserve.gateway.openai.schemas import DetokenizeRequest
from pdserve.gateway.prepare.params import GenerationParams, ModelSummary

MAX_NAME_CHARS = 256  # of an unknown model's name quoted back
NOT_READY_REASON = "no compatible prefill/decode pair is registered for any model yet"


def service_routes(context: RestContext) -> APIRouter:
    """Health, metrics, the model list and the tokenizer routes over `context`."""
    router = APIRouter()
    frontend = context.frontend

    @router.get("/health")
    async def health() -> JSONResponse:
        # NOTE: readiness: 200 only while some model has a compatible prefill/decode pair.
        models = [m.name for m in frontend.list_models()]
        body: dict[str, Any] = {
            "status": "ok",
            "models": models,
            "num_active_requests": context.streamer.num_active_requests,
            "internal_plane": context.internal_plane,
        }
        if frontend.is_draining:
            body.update(status="draining", reason="the gateway is shutting down")
        elif not models:
            body.update(status="not_ready", reason=NOT_READY_REASON)
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    @router.get("/livez")
    async def livez() -> JSONResponse:
        # NOTE: liveness: the process answers; says nothing about backends.
        return JSONResponse({"status": "alive"})

    @router.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(context.metrics.render(), media_type="text/plain; version=0.0.4")

    def model_object(model: ModelSummary, created: int) -> dict[str, Any]:
        return {
            "id": model.name,
            "object": "model",
            "created": created,
            "owned_by": "pdserve",
            "max_model_len": model.max_model_len,
            "batch_invariant": model.batch_invariant,
        }

    @router.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        context.authorize(request)
        created = int(context.now())
        data = [model_object(model, created) for model in frontend.list_models()]
        return JSONResponse({"object": "list", "data": data})

    @router.get("/v1/models/{model:path}")
    async def retrieve_model(request: Request, model: str) -> JSONResponse:
        # NOTE: a name may hold slashes ("org/name"); an empty one is the list's path with a
        # trailing slash, a 404 as every path is exact.
        if not model:
            raise HTTPException(404)
        context.authorize(request)
        for found in frontend.list_models():
            if found.name == model:
                return JSONResponse(model_object(found, int(context.now())))
        raise PdserveError(
            ErrorReason.MODEL_NOT_FOUND,
            f"the model {model[:MAX_NAME_CHARS]!r} does not exist",
            {"param": "model", "model": model[:MAX_NAME_CHARS]},
        )

    async def tokenizer_body(request: Request) -> GenerationParams | DetokenizeRequest:
        context.authorize(request)
        raw = await context.json_body(request)
        return await context.parser.run(parse_tokenizer_body, len(raw), raw, frontend.limits)

    @router.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        params = await tokenizer_body(request)
        if not isinstance(params, GenerationParams):
            raise PdserveError(ErrorReason.INVALID_REQUEST, "a prompt or messages is required")
        token_ids, max_model_len = await frontend.tokenize(params)
        return JSONResponse(
            {"count": len(token_ids), "max_model_len": max_model_len, "tokens": token_ids}
        )

    @router.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        body = await tokenizer_body(request)
        if not isinstance(body, DetokenizeRequest):
            raise PdserveError(ErrorReason.INVALID_REQUEST, "tokens is required")
        return JSONResponse({"prompt": await frontend.detokenize(body.model, body.tokens)})

    return router
