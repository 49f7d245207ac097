"""REST request bodies to validated `GenerationParams`.

`parse_openai_body` parses, translates and checks a completion or chat completion body with the
validator both front ends share (`pdserve.gateway.prepare.validation.validate_request`), and
raises a typed INVALID_REQUEST for anything wrong: a body that is not JSON or not an object, a
wrong type (no coercion), a lone surrogate, an integer or nesting depth the parser refuses.

It is a pure function of bytes and limits, so `ParserPool` can run it in a worker process:
parsing holds the GIL from start to end (pydantic's parser is native code that builds Python
objects), and a crafted body of a few MiB takes a second to parse, which on the gateway's
process would stall the event loop. What comes back from a worker is small: the validator has
bounded every field by then.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import pydantic

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.gateway.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pdserve.gateway.prepare.params import GenerationParams
from pdserve.gateway.prepare.validation import RequestLimits, check_counts, validate_request
from pdserve.gateway.request import ApiKind

MAX_ERROR_CHARS = 200  # of a parser's message quoted in an error


class OpenAIBody(NamedTuple):
    """A parsed REST request: its params and what shapes the response."""

    params: list[GenerationParams]
    model: str
    stream: bool
    include_usage: bool
    return_token_ids: bool
    continuous_usage: bool = False
    resumable: bool = False


def _invalid(message: str, param: str | None = None) -> PdserveError:
    return PdserveError(ErrorReason.INVALID_REQUEST, message, {"param": param} if param else {})


def from_validation_error(exc: pydantic.ValidationError) -> PdserveError:
    """The INVALID_REQUEST of a body's first schema error, naming its top-level parameter.

    Union tags in angle brackets (``<list>``, see `responses_api.schemas`) are left out of the
    location it quotes.
    """
    first = exc.errors(include_url=False, include_input=False)[0]
    loc = tuple(p for p in first["loc"] if not (isinstance(p, str) and p[:1] + p[-1:] == "<>"))
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


def parse_tokenizer_body(raw: bytes, limits: RequestLimits) -> GenerationParams | DetokenizeRequest:
    """Parses ``/tokenize`` (as `GenerationParams`, validated) or ``/detokenize`` bodies.

    Raises:
        PdserveError: INVALID_REQUEST (with ``param`` where one is at fault).
    """
    try:
        data = pydantic.TypeAdapter(TokenizeRequest | DetokenizeRequest).validate_json(raw)
    except pydantic.ValidationError as exc:
        raise from_validation_error(exc) from None
    if isinstance(data, DetokenizeRequest):
        check_counts(limits, num_prompt_tokens=len(data.tokens))
        return data
    check_counts(limits, num_messages=len(data.messages or ()))
    return validate_request(data.to_params(), limits)


def parse_openai_body(raw: bytes, kind: ApiKind, limits: RequestLimits) -> OpenAIBody:
    """Parses and validates the JSON body of a completion (`ApiKind.COMPLETIONS`) or chat
    completion (`ApiKind.CHAT`) request.

    Raises:
        PdserveError: INVALID_REQUEST (with ``param`` where one is at fault).
    """
    body_cls: type[CompletionRequest | ChatCompletionRequest] = (
        ChatCompletionRequest if kind is ApiKind.CHAT else CompletionRequest
    )
    try:
        body: Any = body_cls.model_validate_json(raw)
    except pydantic.ValidationError as exc:
        raise from_validation_error(exc) from None
    check_counts(
        limits,
        num_messages=len(getattr(body, "messages", ())),
        num_stop_strings=len(body.stop) if isinstance(body.stop, list) else 0,
        num_stop_token_ids=len(body.stop_token_ids or ()),
        num_tools=len(getattr(body, "tools", None) or ()),
        num_bad_words=len(body.bad_words or ()),
        num_allowed_token_ids=len(body.allowed_token_ids or ()),
    )
    prompts = body.to_params()
    if len(prompts) > limits.max_prompts:
        raise _invalid(f"at most {limits.max_prompts} prompts per request", "prompt")
    params = [validate_request(one, limits) for one in prompts]
    if body.resumable:
        _check_resumable(params)
    return OpenAIBody(
        params,
        body.model,
        body.stream,
        body.include_usage,
        bool(body.return_token_ids),
        body.continuous_usage,
        body.resumable,
    )


def _check_resumable(params: list[GenerationParams]) -> None:
    """A resumable stream is one completion of one prompt, without logprobs (a resumed stream
    replays tokens, not their logprobs)."""
    param = "stream_options.resumable"
    if len(params) != 1 or params[0].n != 1:
        raise _invalid("a resumable stream needs one prompt and n = 1", param)
    if params[0].logprobs is not None or params[0].prompt_logprobs is not None:
        raise _invalid("a resumable stream cannot return logprobs", param)
