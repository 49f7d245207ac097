"""GenerationService request bytes to validated `GenerationParams`.

`parse_generate_request` parses, translates and checks a serialized ``GenerateRequest`` with the
validator both front ends share (`pdserve.gateway.prepare.validation.validate_request`), and
raises a typed INVALID_REQUEST for anything wrong, bytes that are not protobuf included. Like
`pdserve.gateway.openai.parsing`, it is a pure function of bytes and limits that `ParserPool`
runs in a worker process for large messages.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from google.protobuf.message import DecodeError

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.gateway.grpc_api import convert
from pdserve.gateway.prepare.params import GenerationParams
from pdserve.gateway.prepare.validation import RequestLimits, check_counts, validate_request
from pdserve.v1 import generation_pb2

MAX_ERROR_CHARS = 200  # of a parser's message quoted in an error


class GenerateBody(NamedTuple):
    """A parsed GenerationService.Generate request."""

    params: GenerationParams
    include_prompt_token_ids: bool
    resumable: bool = False


def _invalid(message: str, param: str | None = None) -> PdserveError:
    return PdserveError(ErrorReason.INVALID_REQUEST, message, {"param": param} if param else {})


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
        num_tools=len(request.tools),
        num_bad_words=len(request.bad_words) + len(request.sampling.bad_words),
        num_allowed_token_ids=len(request.sampling.allowed_token_ids),
    )
    params = validate_request(convert.generation_params_from_pb(request), limits)
    if request.resumable:
        if params.n != 1:
            raise _invalid("a resumable request needs n = 1", "resumable")
        if params.logprobs is not None or params.prompt_logprobs is not None:
            raise _invalid("a resumable request cannot return logprobs", "resumable")
    return GenerateBody(params, request.include_prompt_token_ids, request.resumable)


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
