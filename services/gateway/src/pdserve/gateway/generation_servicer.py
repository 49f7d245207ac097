"""GenerationService: the public gRPC API, with the semantics of the REST endpoints."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace

from pdserve.common import telemetry
from pdserve.common.errors import PdserveError, abort_with_error
from pdserve.gateway import convert
from pdserve.gateway.auth import check_bearer
from pdserve.gateway.pipeline import Pipeline
from pdserve.v1 import generation_pb2, generation_pb2_grpc


def _authorization(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value if isinstance(value, str) else value.decode()
    return None


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    """Serves GenerationService on top of the shared `Pipeline`.

    Args:
        pipeline: Validation, tokenization and streaming.
        api_key: Required as ``authorization: Bearer <key>`` metadata when set.
    """

    def __init__(self, pipeline: Pipeline, api_key: str | None = None) -> None:
        self._pipeline = pipeline
        self._api_key = api_key

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """Generates a completion as a stream of deltas; the last one has finish reason and usage.

        Errors use the pdserve.v1 error model (INVALID_REQUEST, PROMPT_TOO_LONG,
        MODEL_NOT_FOUND, UNAUTHENTICATED, NO_HEALTHY_INSTANCES, ...). Cancelling the call aborts
        the request on its prefill and releases its decode lease.
        """
        try:
            check_bearer(_authorization(context), self._api_key)
            prepared = await self._pipeline.prepare(convert.generation_params_from_pb(request))
            # NOTE: with tracing on, the current span is the server interceptor's (parented on
            # the caller's traceparent); gateway.request becomes its child.
            trace.get_current_span().set_attribute(telemetry.REQUEST_ID, prepared.request_id)
            request_id = prepared.client_request_id or prepared.request_id
            prompt_ids = prepared.prompt_token_ids if request.include_prompt_token_ids else ()
            deltas = self._pipeline.stream(prepared)
            async with contextlib.aclosing(deltas):
                async for delta in deltas:
                    yield convert.generate_response_to_pb(request_id, delta, prompt_ids)
                    prompt_ids = ()
        except PdserveError as error:
            await abort_with_error(context, error)

    async def ListModels(
        self, request: generation_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.ListModelsResponse:
        """Lists the models that have at least one compatible prefill/decode pair."""
        try:
            check_bearer(_authorization(context), self._api_key)
        except PdserveError as error:
            await abort_with_error(context, error)
        return generation_pb2.ListModelsResponse(
            models=[
                generation_pb2.Model(
                    name=model.name,
                    max_model_len=model.max_model_len,
                    num_prefill_instances=model.num_prefill_instances,
                    num_decode_instances=model.num_decode_instances,
                )
                for model in self._pipeline.list_models()
            ]
        )
