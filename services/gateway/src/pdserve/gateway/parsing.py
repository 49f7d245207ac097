"""Request bytes to validated `GenerationParams`, for both front ends.

`parse_openai_body` (a REST body) and `parse_generate_request` (a gRPC ``GenerateRequest``)
parse, translate and check a request with the validator both front ends share
(`pdserve.gateway.validation.validate_request`), and raise a typed INVALID_REQUEST for
anything wrong: a body that is not JSON or not an object, a wrong type (no coercion), a
lone surrogate, an integer or nesting depth the parser refuses, a message that is not
protobuf.

They are pure functions of bytes and limits, so `ParserPool` can run them in a worker process:
parsing holds the GIL from start to end (pydantic's and protobuf's parsers are native code that
builds Python objects), and a crafted body of a few MiB takes a second to parse, which on the
gateway's process would stall the event loop. What comes back from a worker is small: the
validator has bounded every field by then.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import pydantic
from google.protobuf.message import DecodeError

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.gateway import convert
from pdserve.gateway.openai_schemas import ChatCompletionRequest, CompletionRequest
from pdserve.gateway.params import GenerationParams
from pdserve.gateway.validation import RequestLimits, check_counts, validate_request
from pdserve.v1 import generation_pb2

MAX_ERROR_CHARS = 200  # of a parser's message quoted in an error


class OpenAIBody(NamedTuple):
    """A parsed REST request: its params and what shapes the response."""

    params: GenerationParams
    model: str
    stream: bool
    include_usage: bool
    return_token_ids: bool


class GenerateBody(NamedTuple):
    """A parsed GenerationService.Generate request."""

    params: GenerationParams
    include_prompt_token_ids: bool


def _invalid(message: str, param: str | None = None) -> PdserveError:
    return PdserveError(ErrorReason.INVALID_REQUEST, message, {"param": param} if param else {})


def _from_validation_error(exc: pydantic.ValidationError) -> PdserveError:
    first = exc.errors(include_url=False, include_input=False)[0]
    loc = first["loc"]
    msg = first["msg"][:MAX_ERROR_CHARS]
    if first["type"] == "json_invalid":
        return _invalid(f"the request body is not valid JSON: {msg}")
    if first["type"] == "model_type" and not loc:
        return _invalid("the request body must be a JSON object")
    # NOTE: the top-level parameter; deeper parts of `loc` include pydantic's union tags.
    where = ".".join(str(part) for part in loc)[:MAX_ERROR_CHARS]
    message = f"{where}: {msg}" if where else msg
    if first["type"] == "extra_forbidden":
        message = f"unrecognized request argument: {where}"
    return _invalid(message, str(loc[0])[:MAX_ERROR_CHARS] if loc else None)


def parse_openai_body(raw: bytes, is_chat: bool, limits: RequestLimits) -> OpenAIBody:
    """Parses and validates the JSON body of a completion or chat completion request.

    Raises:
        PdserveError: INVALID_REQUEST (with ``param`` where one is at fault).
    """
    body_cls: type[CompletionRequest | ChatCompletionRequest] = (
        ChatCompletionRequest if is_chat else CompletionRequest
    )
    try:
        body: Any = body_cls.model_validate_json(raw)
    except pydantic.ValidationError as exc:
        raise _from_validation_error(exc) from None
    check_counts(
        limits,
        num_messages=len(getattr(body, "messages", ())),
        num_stop_strings=len(body.stop) if isinstance(body.stop, list) else 0,
        num_stop_token_ids=len(body.stop_token_ids or ()),
    )
    params = validate_request(body.to_params(), limits)
    return OpenAIBody(
        params, body.model, body.stream, body.include_usage, bool(body.return_token_ids)
    )


def parse_generate_request(raw: bytes, limits: RequestLimits) -> GenerateBody:
    """Parses and validates a serialized GenerateRequest.

    Raises:
        PdserveError: INVALID_REQUEST, also for bytes that are not a GenerateRequest (gRPC's
            own parser would fail the call as UNKNOWN, without ErrorInfo).
    """
    request = parse_message(generation_pb2.GenerateRequest, raw)
    check_counts(
        limits,
        num_messages=len(request.chat.messages),
        num_prompt_tokens=len(request.token_ids.token_ids),
        num_stop_strings=len(request.stop),
        num_stop_token_ids=len(request.sampling.stop_token_ids),
    )
    params = validate_request(convert.generation_params_from_pb(request), limits)
    return GenerateBody(params, request.include_prompt_token_ids)


def parse_message(message_cls: Any, raw: bytes) -> Any:
    """A protobuf message from its bytes.

    Raises:
        PdserveError: INVALID_REQUEST when the bytes are not a valid `message_cls`.
    """
    try:
        return message_cls.FromString(raw)
    except DecodeError as exc:
        name = message_cls.DESCRIPTOR.full_name
        raise _invalid(f"the request is not a valid {name}: {exc}"[:MAX_ERROR_CHARS]) from None
