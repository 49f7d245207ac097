"""A Responses API body to a chat request's `GenerationParams`.

The request becomes the chat request a client would have sent for the same conversation:
``instructions`` is a first system message, each input message one chat message (its text
parts joined; ``developer`` is ``system``, as in chat), consecutive ``function_call`` items one
assistant message's ``tool_calls`` (the assistant message right before them, if any, is theirs),
each ``function_call_output`` a ``tool`` message, ``max_output_tokens`` is max_tokens,
``text.format`` the `Constraint` the engine decodes under and function ``tools`` chat's
(`pdserve.gateway.openai.responses_api.tools`). So the same conversation and seed give the same
tokens on ``/v1/responses`` as on ``/v1/chat/completions``.

`parse_responses_body` is a pure function of bytes and limits, like
`pdserve.gateway.openai.parsing.parse_openai_body`, so large bodies parse in a worker process.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, NamedTuple, cast

import pydantic

from pdserve.common.generation import Constraint, ConstraintKind
from pdserve.gateway.openai.parsing import from_validation_error
from pdserve.gateway.openai.responses_api.input_schemas import (
    Content,
    ContentPart,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    InputTextPart,
    MessageItem,
    OutputTextPart,
    ReasoningItem,
    RefusalPart,
)
from pdserve.gateway.openai.responses_api.schemas import ResponsesRequest, TextConfig
from pdserve.gateway.openai.responses_api.tools import echoed_tools, function_tools, tool_choice
from pdserve.gateway.prepare.params import (
    ChatMessage,
    GenerationParams,
    PromptKind,
    effort_variables,
)
from pdserve.gateway.prepare.validation import RequestLimits, invalid, validate_request
from pdserve.gateway.tools.spec import ToolCall

ASSISTANT_PARTS = ("input_text", "output_text", "refusal")


class ResponsesBody(NamedTuple):
    """A parsed ``POST /v1/responses``: its params and what the `Response` object repeats.

    Attributes:
        params: The validated chat request.
        model: The model as the client named it.
        stream: Stream the response's events.
        echoed: The request's settings as a `Response` object states them (``instructions``,
            ``max_output_tokens``, ``text``, ``tools``, ...), JSON-ready.
        background: Run it in the background (`pdserve.gateway.openai.responses_api.stored`).
        store: Keep it once it ended (``store``, true unless the client says false).
        previous_response_id: The response it continues (its input holds that response's
            conversation once the gateway put it there: `StoredResponses.continued`).
    """

    params: GenerationParams
    model: str
    stream: bool
    echoed: dict[str, Any]
    background: bool = False
    store: bool = True
    previous_response_id: str | None = None


def parse_responses_body(raw: bytes, limits: RequestLimits) -> ResponsesBody:
    """Parses and validates the JSON body of a Responses API request.

    Raises:
        PdserveError: INVALID_REQUEST (with ``param``), also for every parameter set to
            something pdserve does not implement.
    """
    try:
        request = ResponsesRequest.model_validate_json(raw)
    except pydantic.ValidationError as exc:
        raise from_validation_error(exc) from None
    refusal = request.refusal()
    if refusal is not None:
        param, message = refusal
        raise invalid(message, param)
    params = validate_request(to_params(request, limits), limits)
    return ResponsesBody(
        params,
        request.model,
        request.stream,
        _echoed(request),
        bool(request.background),
        request.store is not False,
        request.previous_response_id,
    )


def to_params(request: ResponsesRequest, limits: RequestLimits) -> GenerationParams:
    """The request as chat `GenerationParams` (not yet validated).

    Raises:
        PdserveError: INVALID_REQUEST for an input item, content part, tool or size pdserve
            refuses.
    """
    return GenerationParams(
        **request.shared_params(),
        kind=PromptKind.CHAT,
        messages=_messages(request, limits),
        max_tokens=request.max_output_tokens,
        max_tokens_name="max_output_tokens",
        tools=function_tools(request),
        tool_choice=tool_choice(request),
        parallel_tool_calls=request.parallel_tool_calls is not False,
        constraint=constraint_of(request.text),
        constraint_name="text.format",
        shows_reasoning=True,
        template_variables=effort_variables(request.reasoning_effort),
        drops_old_messages=request.truncation == "auto",
        logprobs=(request.top_logprobs or 0) if request.wants_logprobs else None,
        logprobs_name="top_logprobs",
    )


def constraint_of(text: TextConfig | None) -> Constraint | None:
    """The `Constraint` of ``text.format``: None for free text, any JSON object for
    ``json_object``, the schema's JSON text for ``json_schema`` (its key order kept, written as
    chat's ``response_format`` writes it, so both share the instances' compiled grammar)."""
    format_ = text.get("format") if text else None
    if format_ is None or format_["type"] == "text":
        return None
    if format_["type"] == "json_object":
        return Constraint(ConstraintKind.JSON_OBJECT)
    return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(format_["schema"]))


def _messages(request: ResponsesRequest, limits: RequestLimits) -> tuple[ChatMessage, ...]:
    """``instructions`` and ``input`` as chat messages, within the request limits."""
    messages = [ChatMessage("system", request.instructions)] if request.instructions else []
    items = request.input
    if isinstance(items, str):
        messages.append(ChatMessage("user", items))
    elif not items:
        raise invalid("input must not be empty", "input")
    elif len(items) + len(messages) > limits.max_messages:
        raise invalid(f"at most {limits.max_messages} input items", "input")
    else:
        messages.extend(_item_messages(items))
    num_chars = sum(m.num_chars for m in messages)
    if num_chars > limits.max_prompt_chars:
        raise invalid(
            f"the input has {num_chars} characters; at most {limits.max_prompt_chars} are accepted",
            "input",
        )
    return tuple(messages)


def _item_messages(items: list[InputItem]) -> list[ChatMessage]:
    """Input items as chat messages: consecutive function calls are one assistant message's
    calls (joining the assistant message right before them), each call output a tool message;
    a reasoning item is the reasoning of the assistant message (or calls) after it.

    Raises:
        PdserveError: INVALID_REQUEST naming the item (or part) pdserve refuses, and a
            function_call_output that answers no earlier function_call.
    """
    messages: list[ChatMessage] = []
    call_ids: set[str] = set()
    for index, item in enumerate(items):
        param = f"input[{index}]"
        kind = item.get("type", "message")
        if kind == "function_call":
            call_item = cast(FunctionCallItem, item)
            call = ToolCall(call_item["call_id"], call_item["name"], call_item["arguments"])
            call_ids.add(call.id)
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                messages[-1] = replace(last, tool_calls=(*last.tool_calls, call))
            else:
                messages.append(ChatMessage("assistant", None, tool_calls=(call,)))
        elif kind == "function_call_output":
            output = cast(FunctionCallOutputItem, item)
            if output["call_id"] not in call_ids:
                raise invalid(
                    f"{param}.call_id {output['call_id'][:64]!r} answers no function_call item "
                    "before it",
                    f"{param}.call_id",
                )
            text = _text(output["output"], ("input_text",), f"{param}.output")
            messages.append(ChatMessage("tool", text, tool_call_id=output["call_id"]))
        elif kind == "message":
            message = _message(cast(MessageItem, item), param)
            last = messages[-1] if messages else None
            if message.role == "assistant" and last is not None and _is_reasoning_alone(last):
                messages[-1] = replace(last, content=message.content)
            else:
                messages.append(message)
        elif kind == "reasoning":
            reasoning = _reasoning(cast(ReasoningItem, item), param)
            last = messages[-1] if messages else None
            if last is not None and _is_reasoning_alone(last):
                messages[-1] = replace(last, reasoning=f"{last.reasoning}\n{reasoning}")
            else:
                messages.append(ChatMessage("assistant", None, reasoning=reasoning))
        else:
            raise invalid(f"input items of type {kind[:64]!r} are not supported", param)
    # NOTE: reasoning with nothing after it (a response cut short) is an assistant turn still.
    return [replace(m, content="") if _is_reasoning_alone(m) else m for m in messages]


def _is_reasoning_alone(message: ChatMessage) -> bool:
    """An assistant message made of a reasoning item, which no answer or call has joined yet."""
    return (
        message.role == "assistant"
        and message.reasoning is not None
        and message.content is None
        and not message.tool_calls
    )


def _reasoning(item: ReasoningItem, param: str) -> str:
    """A reasoning item's text: its ``reasoning_text`` parts, else its summary's."""
    parts = item.get("content") or item["summary"]
    if not parts and item.get("encrypted_content"):
        raise invalid(
            "encrypted reasoning cannot be read: send the reasoning item's content, or leave "
            "the item out",
            f"{param}.encrypted_content",
        )
    return "".join(part["text"] for part in parts)


def _message(message: MessageItem, param: str) -> ChatMessage:
    """One message item as a chat message (its text parts joined)."""
    allowed = ASSISTANT_PARTS if message["role"] == "assistant" else ("input_text",)
    return ChatMessage(message["role"], _text(message["content"], allowed, f"{param}.content"))


def _text(content: Content, allowed: tuple[str, ...], param: str) -> str:
    if isinstance(content, str):
        return content
    return "".join(
        _part_text(part, allowed, f"{param}[{index}]") for index, part in enumerate(content)
    )


def _part_text(part: ContentPart, allowed: tuple[str, ...], param: str) -> str:
    kind = part["type"]
    if kind not in allowed:
        if kind in ASSISTANT_PARTS:
            raise invalid(f"{kind} parts belong to assistant messages", param)
        raise invalid(f"content parts of type {kind[:64]!r} are not supported (text only)", param)
    if kind == "refusal":
        return cast(RefusalPart, part)["refusal"]
    return cast(InputTextPart | OutputTextPart, part)["text"]


def _echoed(request: ResponsesRequest) -> dict[str, Any]:
    """What a `Response` object repeats of its request (sampling values are the prepared
    request's, added by the writer)."""
    format_ = (request.text.get("format") if request.text else None) or {"type": "text"}
    return {
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "metadata": dict(request.metadata or {}),
        "text": {"format": dict(format_)},
        "truncation": request.truncation or "disabled",
        "top_logprobs": request.top_logprobs,
        "max_tool_calls": request.max_tool_calls,
        "prompt_cache_key": request.prompt_cache_key,
        "prompt_cache_retention": request.prompt_cache_retention,
        "safety_identifier": request.safety_identifier,
        "previous_response_id": request.previous_response_id,
        "reasoning": {"effort": request.reasoning_effort, "summary": None},
        **echoed_tools(request),
        "user": request.user,
    }
