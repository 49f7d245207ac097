"""GenerationService: the public gRPC API, with the semantics of the REST endpoints.

The servicer receives each request as bytes and parses it itself (`add_to_server` registers it
without gRPC's deserializer): a message that does not parse is then INVALID_ARGUMENT with
ErrorInfo like any other bad request, where gRPC's own parser would fail the call as UNKNOWN
without one. Large messages parse in a worker process
(`pdserve.gateway.prepare.workers.ParserPool`).
"""

from __future__ import annotations

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
from pdserve.gateway.access.auth import authenticate
from pdserve.gateway.frontend import Frontend
from pdserve.gateway.grpc_api import convert
from pdserve.gateway.grpc_api.parsing import GenerateBody, parse_generate_request, parse_message
from pdserve.gateway.prepare.workers import ParserPool
from pdserve.gateway.request import ApiKind
from pdserve.gateway.session.access import Lookup, not_found
from pdserve.gateway.session.run import RunMoved
from pdserve.gateway.session.session import Parsed, Session, SessionMode
from pdserve.gateway.session.sessions import Sessions
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
    """Serves GenerationService on top of the shared `Frontend` and the session layer.

    Args:
        frontend: Validation and tokenization (and the request limits).
        sessions: Opens every request and resumes kept ones (``resumable``, ``Resume``;
            refused where it cannot keep requests).
        limiter: Admission of Generate calls (per API key and in total).
        parser: Parses large requests in worker processes.
        api_keys: Keys accepted as ``authorization: Bearer <key>`` metadata; None or an open
            store: any.
    """

    def __init__(
        self,
        frontend: Frontend,
        sessions: Sessions,
        limiter: ConcurrencyLimiter,
        parser: ParserPool,
        api_keys: ApiKeyStore | None = None,
    ) -> None:
        self._frontend = frontend
        self._sessions = sessions
        self._limiter = limiter
        self._parser = parser
        self._api_keys = api_keys or ApiKeyStore()
        sessions.parse_stored_with(KIND, self._parse)

    async def Generate(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """Generates a completion as a stream of deltas; the last one has finish reason and usage.

        Errors use the pdserve.v1 error model (INVALID_REQUEST, PROMPT_TOO_LONG,
        MODEL_NOT_FOUND, UNAUTHENTICATED, RATE_LIMITED, NO_HEALTHY_INSTANCES, ...). Cancelling
        the call aborts the request on its prefill and releases its decode lease (a
        ``resumable`` one keeps running: the call only stops following it).
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
                if body.resumable and not self._sessions.can_keep:
                    raise PdserveError(
                        ErrorReason.INVALID_REQUEST,
                        "resumable requests are not enabled on this gateway",
                        {"param": "resumable"},
                    )
                prepared = await self._frontend.prepare(body.params, None, caller.api_key_name)
                span.set_attribute(telemetry.REQUEST_ID, prepared.request_id)
                mode = SessionMode.RESUMABLE if body.resumable else SessionMode.PLAIN
                session = await self._sessions.open(KIND, [prepared], caller, mode, raw, body)
                # NOTE: a resumable request is named by the gateway's id (Resume takes it).
                request_id = prepared.request_id
                if not body.resumable:
                    request_id = prepared.client_request_id or request_id
                messages = _messages(session, request_id, body, None)
                async with contextlib.aclosing(messages):
                    async for message in messages:
                        yield message
        except PdserveError as error:
            await abort_with_error(context, error)
        except Exception as exc:
            await abort_with_error(context, _internal(exc))

    async def Resume(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.ResumeResponse]:
        """Streams a resumable request again from a completion index (see the contract)."""
        try:
            caller = authenticate(_authorization(context), self._api_keys)
            request = parse_message(generation_pb2.ResumeRequest, raw)
            if not self._sessions.can_keep:
                raise not_found(KIND, request.request_id)
            lookup = Lookup(request.request_id, (KIND,), caller)
            session = await self._sessions.resume(lookup, self._parse)
            assert isinstance(session.body, GenerateBody)
            # NOTE: completion index k is position k; from index 0 is from the start.
            after = request.from_index or None
            with self._limiter.admit(caller):
                messages = _messages(session, session.request_id, session.body, after)
                async with contextlib.aclosing(messages):
                    async for message in messages:
                        yield generation_pb2.ResumeResponse(response=message)
        except PdserveError as error:
            await abort_with_error(context, error)
        except Exception as exc:
            await abort_with_error(context, _internal(exc))

    async def _parse(self, stored: bytes) -> Parsed:
        limits = self._frontend.limits
        body = await self._parser.run(parse_generate_request, len(stored), stored, limits)
        return Parsed(body, body.params)

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
                    batch_invariant=model.batch_invariant,
                )
                for model in self._frontend.list_models()
            ]
        )


async def _messages(
    session: Session, request_id: str, body: GenerateBody, after: int | None
) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
    """The messages of a session's deltas a client at position `after` needs (None: all),
    the first one with the prompt's tokens when asked; a stream another gateway took over
    just ends (the client resumes there)."""
    prompt_ids = session.prepared.prompt_token_ids if body.include_prompt_token_ids else ()
    deltas = session.deltas(after)
    try:
        async for index, delta in deltas:
            yield convert.generate_response_to_pb(request_id, delta, prompt_ids, index)
            prompt_ids = ()
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
