"""GenerationService: the public gRPC API, with the semantics of the REST endpoints.

The servicer receives each request as bytes and parses it itself (`add_to_server` registers it
without gRPC's deserializer): a message that does not parse is then INVALID_ARGUMENT with
ErrorInfo like any other bad request, where gRPC's own parser would fail the call as UNKNOWN
without one. Large messages parse in a worker process
(`pdserve.gateway.prepare.workers.ParserPool`).
"""

from __future__ import annotations

import base64
import contextlib
import uuid
from collections.abc import AsyncGenerator, AsyncIterator

import grpc
import structlog
from opentelemetry import trace

from pdserve.common import telemetry
from pdserve.common.errors import ErrorReason, PdserveError, abort_with_error
from pdserve.gateway.access.admission import ConcurrencyLimiter
from pdserve.gateway.access.api_keys import ApiKeyStore
from pdserve.gateway.access.auth import Caller, authenticate
from pdserve.gateway.choices import merged
from pdserve.gateway.frontend import Frontend
from pdserve.gateway.grpc_api import convert
from pdserve.gateway.grpc_api.parsing import GenerateBody, parse_generate_request, parse_message
from pdserve.gateway.prepare.params import PreparedRequest
from pdserve.gateway.prepare.workers import ParserPool
from pdserve.gateway.request import ApiKind, OutputDelta
from pdserve.gateway.resume.access import find, prepare_again, reopen
from pdserve.gateway.resume.run import Run, RunMoved
from pdserve.gateway.resume.runs import Runs
from pdserve.gateway.resume.store import ResumeRecord
from pdserve.gateway.streaming import Streamer
from pdserve.v1 import generation_pb2

log = structlog.get_logger("pdserve.gateway.grpc_api.servicer")

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
KIND = ApiKind.GRPC


def _internal(exc: Exception) -> PdserveError:
    """INTERNAL (with ErrorInfo, like every error) for an exception nothing expected."""
    request_id = uuid.uuid4().hex
    log.exception("internal_error", request_id=request_id, error=type(exc).__name__)
    return PdserveError(
        ErrorReason.INTERNAL,
        f"internal server error (request id {request_id})",
        {"requestId": request_id},
    )


def _authorization(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value if isinstance(value, str) else value.decode()
    return None


class GenerationServicer:
    """Serves GenerationService on top of the shared `Frontend`.

    Args:
        frontend: Validation and tokenization (and the request limits).
        streamer: Runs prepared requests.
        limiter: Admission of Generate calls (per API key and in total).
        parser: Parses large requests in worker processes.
        api_keys: Keys accepted as ``authorization: Bearer <key>`` metadata; None or an open
            store: any.
        runs: Resumable requests (``resumable``, ``Resume``); None: refused.
    """

    def __init__(
        self,
        frontend: Frontend,
        streamer: Streamer,
        limiter: ConcurrencyLimiter,
        parser: ParserPool,
        api_keys: ApiKeyStore | None = None,
        runs: Runs | None = None,
    ) -> None:
        self._runs = runs
        self._frontend = frontend
        self._streamer = streamer
        self._limiter = limiter
        self._parser = parser
        self._api_keys = api_keys or ApiKeyStore()

    async def Generate(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """Generates a completion as a stream of deltas; the last one has finish reason and usage.

        Errors use the pdserve.v1 error model (INVALID_REQUEST, PROMPT_TOO_LONG,
        MODEL_NOT_FOUND, UNAUTHENTICATED, RATE_LIMITED, NO_HEALTHY_INSTANCES, ...). Cancelling
        the call aborts the request on its prefill and releases its decode lease.
        """
        try:
            caller = authenticate(_authorization(context), self._api_keys)
            # NOTE: with tracing on, the current span is the server interceptor's (parented on
            # the caller's traceparent); gateway.request becomes its child.
            span = trace.get_current_span()
            if caller.api_key_name is not None:
                span.set_attribute(telemetry.API_KEY_NAME, caller.api_key_name)
            with self._limiter.admit(caller):
                body = await self._parser.run(
                    parse_generate_request, len(raw), raw, self._frontend.limits
                )
                prepared = await self._frontend.prepare(body.params, None, caller.api_key_name)
                span.set_attribute(telemetry.REQUEST_ID, prepared.request_id)
                if body.resumable:
                    run = await self._start_resumable(raw, prepared, caller)
                    messages = _messages(run.follow(), prepared, body, 0)
                    async with contextlib.aclosing(messages):
                        async for message in messages:
                            yield message
                    return
                request_id = prepared.client_request_id or prepared.request_id
                prompt_ids = prepared.prompt_token_ids if body.include_prompt_token_ids else ()
                deltas = merged([self._streamer.stream(c) for c in prepared.choices()], prepared.n)
                async with contextlib.aclosing(deltas):
                    async for index, delta in deltas:
                        yield convert.generate_response_to_pb(request_id, delta, prompt_ids, index)
                        prompt_ids = ()
        except PdserveError as error:
            await abort_with_error(context, error)
        except Exception as exc:
            await abort_with_error(context, _internal(exc))

    async def _start_resumable(self, raw: bytes, prepared: PreparedRequest, caller: Caller) -> Run:
        if self._runs is None:
            raise PdserveError(
                ErrorReason.INVALID_REQUEST,
                "resumable requests are not enabled on this gateway",
                {"param": "resumable"},
            )
        body = base64.b64encode(raw).decode()
        return await self._runs.begin(KIND, body, prepared, caller.api_key_name)

    async def Resume(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.ResumeResponse]:
        """Streams a resumable request again from a completion index (see the contract)."""
        try:
            caller = authenticate(_authorization(context), self._api_keys)
            request = parse_message(generation_pb2.ResumeRequest, raw)
            found = None
            if self._runs is not None:
                found = await find(self._runs, request.request_id, (KIND,), caller)
            if found is None:
                raise PdserveError(
                    ErrorReason.REQUEST_NOT_FOUND,
                    "no resumable request with that id (unknown, expired or another key's)",
                    {"requestId": request.request_id[:200]},
                )
            assert self._runs is not None
            with self._limiter.admit(caller):
                record = found.record if isinstance(found, Run) else found
                stored = base64.b64decode(record.body)
                limits = self._frontend.limits
                body = await self._parser.run(parse_generate_request, len(stored), stored, limits)

                async def prepare(stored_record: ResumeRecord) -> PreparedRequest:
                    return await prepare_again(self._frontend, body.params, stored_record, caller)

                reopened = await reopen(self._runs, found, prepare)
                prepared = reopened.prepared
                messages = _messages(reopened.deltas(), prepared, body, request.from_index)
                async with contextlib.aclosing(messages):
                    async for message in messages:
                        yield generation_pb2.ResumeResponse(response=message)
        except PdserveError as error:
            await abort_with_error(context, error)
        except Exception as exc:
            await abort_with_error(context, _internal(exc))

    async def ListModels(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> generation_pb2.ListModelsResponse:
        """Lists the models that have at least one compatible prefill/decode pair."""
        try:
            authenticate(_authorization(context), self._api_keys)
            parse_message(generation_pb2.ListModelsRequest, raw)
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
                for model in self._frontend.list_models()
            ]
        )


async def _messages(
    deltas: AsyncGenerator[OutputDelta, None],
    prepared: PreparedRequest,
    body: GenerateBody,
    from_index: int,
) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
    """The messages of a resumable request's deltas from completion index `from_index` on
    (the last one always); a stream another gateway took over just ends (the client resumes
    there)."""
    prompt_ids = prepared.prompt_token_ids if body.include_prompt_token_ids else ()
    try:
        async for delta in deltas:
            if delta.finish_reason is None and delta.first_index < from_index:
                continue
            message = convert.generate_response_to_pb(prepared.request_id, delta, prompt_ids)
            prompt_ids = ()
            yield message
    except RunMoved:
        return
    finally:
        await deltas.aclose()


def add_to_server(servicer: GenerationServicer, server: grpc.aio.Server) -> None:
    """Registers `servicer` as GenerationService; requests reach it as bytes (see module doc)."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            response_serializer=generation_pb2.GenerateResponse.SerializeToString,
        ),
        "Resume": grpc.unary_stream_rpc_method_handler(
            servicer.Resume,
            response_serializer=generation_pb2.ResumeResponse.SerializeToString,
        ),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels,
            response_serializer=generation_pb2.ListModelsResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
