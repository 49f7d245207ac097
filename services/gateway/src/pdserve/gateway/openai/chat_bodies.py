"""The chat parts of request bodies: messages (with tool calls), tools and a named tool_choice,
parsed as strictly as the rest of a body (`pdserve.gateway.openai.schemas`), and their
translation to the gateway's `ChatMessage` and `pdserve.gateway.tools.spec` types.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, NotRequired, cast

from pydantic import Tag, with_config
from typing_extensions import TypedDict  # pydantic needs this one before Python 3.12

from pdserve.gateway.openai.strict import STRICT, TEXT_OR_LIST, UnsupportedPart, type_tag
from pdserve.gateway.prepare.messages import invalid
from pdserve.gateway.prepare.params import ChatMessage
from pdserve.gateway.tools.spec import FunctionTool, ToolCall, ToolChoice, ToolChoiceMode


@with_config(STRICT)
class TextContentPart(TypedDict):
    """A text part of a message's content (a part of another type, an image or audio, is
    refused by its place and type: the models served read text only)."""

    type: Literal["text"]
    text: str


ContentPart = Annotated[
    Annotated[TextContentPart, Tag("<text>")] | Annotated[UnsupportedPart, Tag("<other>")],
    type_tag(frozenset({"text"})),
]
Content = Annotated[
    Annotated[str, Tag("<text>")] | Annotated[list[ContentPart], Tag("<list>")], TEXT_OR_LIST
]


@with_config(STRICT)
class FunctionCallBody(TypedDict):
    """The function and arguments of a tool call in the history."""

    name: str
    arguments: str


@with_config(STRICT)
class ToolCallBody(TypedDict):
    """One of an assistant message's ``tool_calls``."""

    id: str
    type: Literal["function"]
    function: FunctionCallBody


@with_config(STRICT)
class ChatMessageBody(TypedDict):
    """One message of ``messages`` (which fields each role needs is checked later, in
    `pdserve.gateway.prepare.messages`)."""

    role: str
    content: NotRequired[Content | None]
    name: NotRequired[str | None]
    tool_calls: NotRequired[list[ToolCallBody] | None]
    tool_call_id: NotRequired[str | None]
    reasoning_content: NotRequired[str | None]


@with_config(STRICT)
class FunctionBody(TypedDict):
    """A function tool's definition."""

    name: str
    description: NotRequired[str | None]
    parameters: NotRequired[dict[str, Any] | None]
    strict: NotRequired[bool | None]


@with_config(STRICT)
class ToolBody(TypedDict):
    """One of ``tools`` (function tools only, as in the chat completions API)."""

    type: Literal["function"]
    function: FunctionBody


@with_config(STRICT)
class FunctionNameBody(TypedDict):
    """The function of a named ``tool_choice``."""

    name: str


@with_config(STRICT)
class NamedToolChoiceBody(TypedDict):
    """``tool_choice`` naming the function to call."""

    type: Literal["function"]
    function: FunctionNameBody


def message_from_body(body: ChatMessageBody, param: str = "messages") -> ChatMessage:
    """A message body as a `ChatMessage` (its text parts joined).

    Raises:
        PdserveError: INVALID_REQUEST for a content part that is not text, naming it
            (``param`` is the message's place, ``messages[2]``).
    """
    content = body.get("content")
    if isinstance(content, list):
        content = "".join(
            _part_text(part, f"{param}.content[{index}]") for index, part in enumerate(content)
        )
    calls = tuple(
        ToolCall(call["id"], call["function"]["name"], call["function"]["arguments"])
        for call in body.get("tool_calls") or ()
    )
    return ChatMessage(
        body["role"],
        content,
        body.get("name"),
        calls,
        body.get("tool_call_id"),
        body.get("reasoning_content"),
    )


def _part_text(part: TextContentPart | UnsupportedPart, param: str) -> str:
    if part["type"] != "text":
        raise invalid(
            f"content parts of type {part['type'][:64]!r} are not supported (text only)", param
        )
    return cast(TextContentPart, part)["text"]


def tool_from_body(body: ToolBody) -> FunctionTool:
    """A tool body as a `FunctionTool` (its parameters schema as JSON text)."""
    function = body["function"]
    parameters = function.get("parameters")
    return FunctionTool(
        function["name"],
        function.get("description"),
        None if parameters is None else json.dumps(parameters, ensure_ascii=False),
        function.get("strict"),
    )


def tool_choice_from_body(body: str | NamedToolChoiceBody | None) -> ToolChoice | None:
    """A ``tool_choice`` body as a `ToolChoice` (None when not given)."""
    if body is None:
        return None
    if isinstance(body, str):
        return ToolChoice(ToolChoiceMode(body))
    return ToolChoice(ToolChoiceMode.FUNCTION, body["function"]["name"])
